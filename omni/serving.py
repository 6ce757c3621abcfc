"""What our HTTP servers share (FastAPI + uvicorn): the reward server (`omni.rewards.serve`)
and the rollout engine's (`omni.rollout.vllm_server`).

`import_server` imports FastAPI and uvicorn, or says where they come from. `OneAtATime`
runs blocking calls (a model's forward) one at a time, in order, on one daemon thread, for
async routes to await: the event loop keeps answering (e.g. /health) meanwhile, and a
server stopping mid-call is not held up by it (a daemon thread ends with the process).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import queue
import threading
from typing import Any, Callable


def import_server(what: str):
    """(fastapi, uvicorn); `what` (e.g. "the reward server") is named if they are missing."""
    try:
        import fastapi
        import uvicorn
    except ImportError as error:
        raise ImportError(
            f"{what} needs FastAPI and uvicorn ({error.name} is missing): pip install -e '.[reward-http]' "
            "(the vLLM engine's environment has them with vLLM)"
        ) from None
    return fastapi, uvicorn


class OneAtATime:
    """A queue of calls served by one daemon thread named `name`."""

    def __init__(self, name: str):
        self._calls: queue.SimpleQueue = queue.SimpleQueue()
        threading.Thread(target=self._serve, name=name, daemon=True).start()

    def _serve(self) -> None:
        while True:
            future, function, args = self._calls.get()
            if not future.set_running_or_notify_cancel():
                continue  # its request was cancelled while queued
            try:
                future.set_result(function(*args))
            except BaseException as error:  # handed to the awaiting route
                future.set_exception(error)

    async def __call__(self, function: Callable[..., Any], *args) -> Any:
        """`function(*args)` on the thread, after the calls queued before it."""
        future: concurrent.futures.Future = concurrent.futures.Future()
        self._calls.put((future, function, args))
        return await asyncio.wrap_future(future)
