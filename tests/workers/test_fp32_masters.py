"""fp32 masters with a bf16 model: the LoRA, its gradients and its AdamW state are fp32 while
the frozen base stays bf16, so an Adam step far below a bf16 ulp of the weights is kept.
Also on 2 gloo ranks with FSDP1 and FSDP2 (slow: spawns processes)."""

import os

import pytest
import torch

from omni.algorithms import flow_grpo
from omni.context import step_seeds
from omni.validation import validate
from tests.conftest import compose_config, training_options

LR = 2e-5  # one Adam step moves a weight by about lr: ~1e-4 of a LoRA weight of 0.2


@pytest.fixture(scope="module")
def worker(tiny_cache, tmp_path_factory):
    from omni.trainer import model_path
    from omni.workers.actor_rollout import ActorRolloutWorker

    overrides = [
        f"model.cache_dir={tiny_cache}",
        "model.dtype=bfloat16",
        f"trainer.lr={LR}",
        "algorithm.num_minibatches=1",
    ]
    cfg = validate(compose_config(overrides, tmp_path_factory.mktemp("run")))
    worker = ActorRolloutWorker(cfg, model_path(cfg.model))
    worker.setup()
    yield worker
    worker.shutdown()


def randomise_lora(worker):
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in worker.trainable:
            p.copy_(torch.randn(p.shape, generator=generator) * 0.2)
    worker.sync_weights()


def one_update(worker):
    """One optimizer step of Flow-GRPO on a fresh rollout; returns the gradients it applied."""
    batch = worker.generate(
        ["a red cat"] * 2 + ["a blue dog"] * 2, step_seeds(0, 0, 4), training_options(worker.cfg, 0)
    )
    grads, step = [], worker.optimizer_step
    worker.optimizer_step = lambda: grads.append([p.grad.clone() for p in worker.trainable]) or step()
    try:
        worker.apply_update(flow_grpo.update, flow_grpo.GRPOBatch(batch, torch.tensor([1.0, -1.0, 0.5, -0.5])), seed=0)
    finally:
        del worker.optimizer_step
    assert len(grads) == 1
    return grads[0]


def test_trainable_parameters_are_fp32_and_the_base_bf16(worker):
    params = list(worker.actor.parameters())
    assert worker.trainable and all(p.dtype == torch.float32 for p in worker.trainable)
    assert all(p.dtype == torch.bfloat16 for p in params if not p.requires_grad)


def test_a_step_below_a_bf16_ulp_is_kept_and_the_optimizer_state_is_fp32(worker):
    randomise_lora(worker)
    before = [p.detach().clone() for p in worker.trainable]
    grads = one_update(worker)
    change = torch.cat([(p.detach() - b).flatten() for p, b in zip(worker.trainable, before)])
    moved = torch.cat([(g != 0).flatten() for g in grads])
    assert moved.float().mean() > 0.5
    assert (change[moved] != 0).float().mean() > 0.99
    assert 0.5 * LR < change[moved].abs().median() < 1.5 * LR

    # the same step on bf16 copies of the weights rounds away almost everywhere
    copies = [torch.nn.Parameter(b.bfloat16()) for b in before]
    for copy, grad in zip(copies, grads):
        copy.grad = grad.bfloat16()
    adam = torch.optim.AdamW(copies, lr=LR, weight_decay=worker.cfg.trainer.weight_decay)
    adam.step()
    bf16_change = torch.cat([(c.detach() - b.bfloat16()).flatten() for c, b in zip(copies, before)])
    assert (bf16_change[moved] != 0).float().mean() < 0.1

    for p in worker.trainable:
        state = worker.optimizer.state[p]
        assert state["exp_avg"].dtype == state["exp_avg_sq"].dtype == torch.float32
    saved = worker.optimizer_state_dict()["state"]
    assert saved and all(s["exp_avg"].dtype == s["exp_avg_sq"].dtype == torch.float32 for s in saved.values())


# ----------------------------------------------------------------- 2 gloo ranks
def _rank(rank: int, world: int, port: int, version: int, out: str) -> None:
    import torch.distributed as dist

    from omni.config.model import LoraConfig
    from omni.fsdp_utils import collect_lora_params
    from omni.models.sd3 import FAMILY, build_tiny_transformer
    from omni.weights import add_lora_adapter
    from omni.workers.sharding import wrap_fsdp

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        model = build_tiny_transformer(0).to(torch.bfloat16).requires_grad_(False)
        add_lora_adapter(model, LoraConfig(rank=4, alpha=8.0, target_modules=list(FAMILY.lora_targets)))
        model = wrap_fsdp(model, version, FAMILY.layer_prefixes, torch.device("cpu"), torch.bfloat16)
        trainable = [p for p in model.parameters() if p.requires_grad]
        adam = torch.optim.AdamW(trainable, lr=1e-3)
        generator = torch.Generator().manual_seed(rank)
        out_ = model(
            hidden_states=torch.randn(2, 4, 8, 8, generator=generator).bfloat16(),
            timestep=torch.tensor([500.0, 700.0]),
            encoder_hidden_states=torch.randn(2, 5, 64, generator=generator).bfloat16(),
            pooled_projections=torch.randn(2, 64, generator=generator).bfloat16(),
            return_dict=False,
        )[0]
        out_.float().square().mean().backward()
        adam.step()
        lora = collect_lora_params(model, False, True, is_diffusers=True, layer_prefixes=FAMILY.layer_prefixes)
        local = lambda p: p.to_local() if hasattr(p, "to_local") else p  # noqa: E731
        result = {
            "output": out_.dtype,
            "trainable": {local(p).dtype for p in trainable},
            "grads": {local(p.grad).dtype for p in trainable if p.grad is not None},
            "state": {t.dtype for s in adam.state.values() for t in (local(s["exp_avg"]), local(s["exp_avg_sq"]))},
            "collected": {t.dtype for t in lora.values()},
            "moved": any(bool(t.abs().sum() > 0) for k, t in lora.items() if "lora_B" in k),
        }
        torch.save(result, f"{out}/rank{rank}.pt")
    finally:
        dist.destroy_process_group()


@pytest.mark.slow
@pytest.mark.parametrize("version", [1, 2])
def test_fsdp_keeps_fp32_masters_with_a_bf16_model(version, tmp_path):
    import torch.multiprocessing as mp

    from omni.distributed import free_port

    mp.spawn(_rank, args=(2, free_port(), version, str(tmp_path)), nprocs=2, join=True)
    for rank in range(2):
        result = torch.load(tmp_path / f"rank{rank}.pt")
        assert result["output"] == torch.bfloat16, result
        assert result["trainable"] == result["grads"] == result["state"] == {torch.float32}, result
        assert result["collected"] == {torch.float32} and result["moved"], result
