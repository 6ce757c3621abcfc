"""Serve any reward of ours over HTTP, for `reward=http` on another machine (FastAPI + uvicorn).

    python -m omni.rewards.serve reward=pickscore reward.components.pickscore.path=/ckpt/pickscore --port 8000
    python recipes/train.py reward=http reward.components.http.url=http://reward-host:8000

The arguments after the flags are the training config's overrides (the `reward` group is
composed and validated as in training); the server scores the weighted sum of the chosen
components. Protocol: `omni.rewards.protocol`, docs/reward_server.md. Requests are scored
one at a time (a reward model is not assumed thread-safe). Needs the `reward-http` extra.
"""

# No `from __future__ import annotations` here: FastAPI reads the route's parameter types at
# run time, and `fastapi` is imported lazily (an extra), so string annotations would not resolve.
import argparse
import logging
import time
from typing import List, Optional, Sequence

from omni.rewards import REWARDS, WeightedReward, reward_options
from omni.rewards.protocol import parse_score_request, scores_answer
from omni.serving import OneAtATime, import_server

logger = logging.getLogger("omni.rewards.serve")


def build_app(reward: WeightedReward, latency_s: float = 0.0):
    """The ASGI app serving `reward` (set up by the caller): GET /health, POST /score; the
    bodies are `omni.rewards.schemas`' models, which /docs shows. `latency_s`: seconds added
    to every scoring, standing in for a remote reward model in benchmarks."""
    fastapi, _ = import_server("the reward server")
    from fastapi.exceptions import RequestValidationError

    from omni.rewards.schemas import Health, Problem, ScoreRequest, ScoreResponse

    app = fastapi.FastAPI(title="omni-recipes reward server", description=__doc__)
    one_at_a_time = OneAtATime("reward")
    names = list(reward.rewards)

    @app.exception_handler(RequestValidationError)
    async def refused(request, error):  # 400 with what is wrong, as the protocol says (not FastAPI's 422)
        where = "; ".join(f"{'.'.join(str(p) for p in e['loc'][1:]) or 'body'}: {e['msg']}" for e in error.errors())
        return fastapi.responses.JSONResponse({"detail": f"bad request body ({where})"}, status_code=400)

    def score(body) -> bytes:
        try:
            images, prompts = parse_score_request(body)
            for prompt in prompts:
                for name, component in reward.rewards.items():
                    problem = type(component).prompt_problem(component.options, prompt)
                    if problem:
                        raise ValueError(f"{prompt.origin} ({str(prompt)[:80]!r}): reward '{name}' needs {problem}")
        except ValueError as error:
            raise fastapi.HTTPException(status_code=400, detail=str(error)) from None
        time.sleep(latency_s)
        try:
            return scores_answer(reward(images, prompts)["reward"])
        except Exception as error:  # the reward failed: the client is told why (and retries)
            logger.exception("scoring %d images failed", len(prompts))
            raise fastapi.HTTPException(status_code=500, detail=f"{type(error).__name__}: {error}") from None

    @app.get("/health", response_model=Health)
    def health():
        return Health(ok=True, reward=names)

    @app.post("/score", response_model=ScoreResponse, responses={400: {"model": Problem}, 500: {"model": Problem}})
    async def score_route(body: ScoreRequest):
        answer = await one_at_a_time(score, body.model_dump())
        # written by scores_answer, not by the model: NaN must stay NaN (pydantic writes null)
        return fastapi.Response(content=answer, media_type="application/json")

    return app


def reward_from_overrides(overrides: Sequence[str]) -> WeightedReward:
    """The training config's `reward` group, composed with `overrides` and typed; bad keys or
    options fail here, naming them, before any reward model loads."""
    from omni.composing import compose_train

    cfg = compose_train(overrides)
    components = {}
    for name, raw in cfg.reward.components.items():
        options = reward_options(name, raw)
        REWARDS.get(name).check_options(options, f"reward.components.{name}")
        components[name] = options
    return WeightedReward(components, cfg.reward.batch_size)


def main(argv: Optional[List[str]] = None) -> None:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--host", default="127.0.0.1", help="address to listen on (0.0.0.0: every interface)")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument(
        "--latency-s", type=float, default=0.0, help="seconds added to every scoring (a slow reward, for benchmarks)"
    )
    parser.add_argument(
        "overrides", nargs="*", help="config overrides, e.g. reward=pickscore reward.components.pickscore.path=..."
    )
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    from hydra.errors import HydraException

    try:
        _, uvicorn = import_server("the reward server")
        reward = reward_from_overrides(args.overrides)
    except (HydraException, ImportError, KeyError, OSError, ValueError) as error:  # each names the key or file
        parser.exit(2, f"omni.rewards.serve: {error.args[0] if isinstance(error, KeyError) else error}\n")
    reward.setup()
    try:
        logger.info("serving %s on http://%s:%d", list(reward.rewards), args.host, args.port)
        uvicorn.run(build_app(reward, args.latency_s), host=args.host, port=args.port, log_level="warning")
    finally:
        reward.teardown()


if __name__ == "__main__":
    main()
