"""The Ray worker group on the CPU: 2 workers compute what 1 does, requests the cluster cannot
hold fail at once with the keys to change, a dead worker stops the run naming it and the
step, and a run attaches to a Ray cluster started beforehand."""

from __future__ import annotations

import os
import secrets
import signal
import subprocess
import tempfile
import time
from pathlib import Path

import pytest
import torch

from omni.algorithms import flow_grpo
from omni.algorithms.advantages import group_advantages
from omni.context import step_seeds
from omni.distributed import free_port
from omni.trainer import model_path
from omni.validation import validate
from tests.conftest import compose_config, one_process_group_at_a_time, training_options
from tests.recipes.test_train import final_lora, train

# every test here starts Ray and worker processes
pytestmark = pytest.mark.slow


@pytest.fixture(autouse=True)
def _alone():
    with one_process_group_at_a_time():
        yield


SMALL = [
    "trainer.batch_size=8", "algorithm.group_size=4", "trainer.micro_batch_size=4", "eval.images_per_prompt=1",
    "rollout.num_steps=4",
]  # fmt: skip


def build(n_workers, tiny_cache, tmp_path, *overrides):
    from omni.workers import build_actor_rollout

    cfg = validate(
        compose_config(
            [f"model.cache_dir={tiny_cache}", f"trainer.n_workers={n_workers}", *SMALL, *overrides], tmp_path
        )
    )
    return cfg, build_actor_rollout(cfg, model_path(cfg.model))


def sampling(cfg, step):
    return training_options(cfg, step)


def max_difference(a: dict, b: dict) -> float:
    assert a.keys() == b.keys() and a
    return max(float((a[k] - b[k]).abs().max()) for k in a)


# SD3 under FSDP2 and with a replicated base (a LoRA's default on a CPU); FLUX (two block
# containers, packed latents, blocks that return views of one tensor) under FSDP2, its engine
# a copy synced one block at a time; Qwen-Image (true CFG, prompts padded to each batch's
# longest) under FSDP1, its engine synced whole. The cells of tests/test_fsdp_utils.py
# collect from both families under FSDP1 and FSDP2.
# SD3's two cells also hold the optimizers: FSDP2 with AdamW and its gradient clipped (active:
# the norm is over ten times 1e-5), the replicated base with plain SGD and no clipping, whose step is
# the gradient itself (AdamW and clipping would both hide a gradient scaled by a constant).
CLIPPED = "trainer.max_grad_norm=1e-5"
MODELS = {
    "sd3-fsdp2": ["model.fsdp.version=2", CLIPPED],
    "sd3-replicated": ["trainer.optimizer=sgd", "trainer.max_grad_norm=0", "trainer.lr=100"],
    "flux-layered": [
        "model=flux_tiny",
        "model.fsdp.version=2",
        "rollout.share_actor=false",
        "rollout.layered_summon=true",
    ],
    "qwen_image-fsdp1": [
        "model=qwen_image_tiny",
        "model.guidance_scale=2.0",
        "model.fsdp.version=1",
        "rollout.share_actor=false",
    ],
    # every weight trains (FSDP2 shards them all) and every sync sends the whole transformer
    "sd3-full": ["model.lora=null", "rollout.share_actor=false"],
}


# FLUX's layered sync and Qwen-Image under FSDP1 are the matrix's two slowest cells (about two
# minutes each on the 2-core CI machine): they run with `pytest -m long`, out of the default
# run's time budget (tests/test_fsdp_utils.py still collects from both families under FSDP1
# and FSDP2, in process groups without Ray).
LONG = ("flux-layered", "qwen_image-fsdp1")
CELLS = [pytest.param(name, marks=pytest.mark.long) if name in LONG else name for name in MODELS]


@pytest.mark.parametrize("model", CELLS)
def test_two_workers_match_one_worker(model, tiny_cache, tmp_path):
    """Same prompts and seeds: the 2-worker rollout is the 1-worker one image by image; the
    update of the same batch (2 minibatches over 2 gloo ranks; FSDP2, or a replicated base
    with the LoRA gradients all-reduced) gives the same LoRA (or, with full fine-tuning, the
    same transformer) and gradient norm; after the update (and the weight sync, for an engine
    with its own copy) both workers sample with the new weights."""
    cfg, one = build(1, tiny_cache, tmp_path, *MODELS[model])
    prompts = ["a red cat"] * 4 + ["a blue dog"] * 4
    seeds = step_seeds(0, 0, len(prompts))
    batch = one.generate(prompts, seeds, sampling(cfg, 0))
    advantages = group_advantages(torch.linspace(0, 1, len(prompts)) ** 2, 4)
    initial_lora = one.trained_state_dict()
    one_metrics = one.apply_update(flow_grpo.update, flow_grpo.GRPOBatch(batch, advantages), seed=7)
    one_lora = one.trained_state_dict()
    one.sync_weights()
    one_after = one.generate(prompts, seeds, sampling(cfg, 1))
    one.shutdown()

    _, two = build(2, tiny_cache, tmp_path, *MODELS[model])
    try:
        assert max_difference(two.trained_state_dict(), initial_lora) == 0
        two_batch = two.generate(prompts, seeds, sampling(cfg, 0))
        two_metrics = two.apply_update(flow_grpo.update, flow_grpo.GRPOBatch(batch, advantages), seed=7)
        two_lora = two.trained_state_dict()
        two.sync_weights()
        two_after = two.generate(prompts, seeds, sampling(cfg, 1))
    finally:
        two.shutdown()

    assert two_batch.prompts == batch.prompts
    assert (two_batch.images - batch.images).abs().max() < 1e-4
    assert (two_batch.latents - batch.latents).abs().max() < 1e-5
    assert (two_batch.log_probs - batch.log_probs).abs().max() < 1e-5
    assert max_difference(one_lora, initial_lora) > 1e-3, "the update did not move the LoRA"
    # With every weight training, Adam's first step (about lr * sign(g)) turns the all-reduce's
    # other summation order into up to ~1e-5 on weights whose gradient is near its eps; a missing
    # or doubled reduction moves weights by the lr, 1e-2
    tolerance = 1e-4 if "model.lora=null" in MODELS[model] else 1e-5
    assert max_difference(two_lora, one_lora) < tolerance
    # Adam's first steps hardly depend on the gradient's scale: the norm checks the normalisation
    assert two_metrics["grad_norm"] == pytest.approx(one_metrics["grad_norm"], rel=1e-4)
    if CLIPPED in MODELS[model]:
        assert one_metrics["grad_norm"] > 1e-4, "the clipping was not active"
    assert (two_after.log_probs - one_after.log_probs).abs().max() < 1e-5


def impossible_requests():
    """case -> (overrides, what the message must name)."""
    too_many = 4 * os.cpu_count()
    return {
        "more CPU workers than CPUs": (
            [f"trainer.n_workers={too_many}", f"trainer.batch_size={4 * too_many}"],
            [f"trainer.n_workers={too_many}", "CPU"],
        ),
        "GPU workers on a cluster without GPUs": (
            ["trainer.n_workers=2", "trainer.n_gpus_per_node=2"],
            ["trainer.n_gpus_per_node=2", "0 GPU"],
        ),
        "a GPU for the in-process worker": (["trainer.n_gpus_per_node=1"], ["trainer.n_gpus_per_node=1", "CUDA"]),
    }


@pytest.mark.parametrize("case", impossible_requests())
def test_impossible_request_fails_fast(case, tmp_path, tiny_cache):
    """No hang: Ray would wait forever for a placement it cannot make."""
    overrides, messages = impossible_requests()[case]
    if "GPU" in case and torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    result = train(tmp_path / "run", tiny_cache, *overrides, check=False, timeout=120)
    output = result.stdout + result.stderr
    assert result.returncode != 0
    assert all(m in output for m in messages), output[-3000:]
    assert "Loading pipeline components" not in output


def test_dead_worker_stops_the_run_and_resume_continues(tmp_path, tiny_cache):
    run_dir = tmp_path / "run"
    common = ["trainer.n_workers=2", "trainer.steps=3", "trainer.save_every=1", *SMALL]
    crash = {**os.environ, "OMNI_TEST_CRASH_WORKER_AT_UPDATE": "1:2"}  # rank 1, its 2nd update
    result = train(run_dir, tiny_cache, *common, check=False, timeout=600, env=crash)
    output = result.stdout + result.stderr
    assert result.returncode != 0
    assert "worker rank 1 of 2" in output and "during training step 2" in output, output[-3000:]
    assert "step_000001, is intact" in output
    checkpoints = run_dir / "checkpoints"
    assert (checkpoints / "latest").read_text().strip() == "step_000001"
    assert not (checkpoints / "step_000002").exists()
    saved = final_lora(run_dir, 1)

    train(run_dir, tiny_cache, *common, "trainer.resume=auto", timeout=300)
    assert max_difference(final_lora(run_dir, 1), saved) == 0
    assert (checkpoints / "latest").read_text().strip() == "step_000003"


@pytest.fixture
def ray_head():
    """A one-node Ray cluster started the way a user starts one (`ray start --head`), stopped
    by signalling its `--block` process, which takes its own processes down. It checks a
    token of its own (Ray's default for `ray start`), which the run is given as a user would."""
    auth = {"RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN": secrets.token_hex(32)}
    port = free_port()
    temp_dir = tempfile.mkdtemp(prefix="ray", dir="/tmp")  # short: Ray's socket paths have a length limit
    command = [
        "ray", "start", "--head", "--block", f"--port={port}", "--num-cpus=2", "--node-ip-address=127.0.0.1",
        f"--temp-dir={temp_dir}", "--include-dashboard=false", f"--ray-client-server-port={free_port()}",
        f"--dashboard-agent-listen-port={free_port()}",
    ]  # fmt: skip
    log = Path(temp_dir) / "ray_start.log"
    with open(log, "w") as out:
        head = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT, env={**os.environ, **auth})
    deadline = time.monotonic() + 90
    while "will now block" not in log.read_text() and head.poll() is None and time.monotonic() < deadline:
        time.sleep(0.5)
    assert head.poll() is None and "will now block" in log.read_text(), log.read_text()[-3000:]
    try:
        yield head, f"127.0.0.1:{port}", auth
    finally:
        head.send_signal(signal.SIGTERM)
        try:
            head.wait(timeout=60)
        except subprocess.TimeoutExpired:
            head.kill()


def test_run_attaches_to_a_running_cluster(ray_head, tmp_path, tiny_cache):
    """trainer.ray_address: the run uses the cluster, with FSDP1 this time, and leaves it up."""
    head, address, auth = ray_head
    result = train(
        tmp_path / "run", tiny_cache, "trainer.n_workers=2", f"trainer.ray_address={address}", "trainer.steps=1",
        "model.fsdp.version=1", *SMALL, timeout=300, env={**os.environ, **auth},
    )  # fmt: skip
    assert "Connecting to existing Ray cluster" in result.stdout + result.stderr
    assert final_lora(tmp_path / "run", 1)
    assert head.poll() is None, "the run stopped a cluster it did not start"
