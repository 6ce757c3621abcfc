"""Check omni.fsdp_utils.collect_lora_params on CUDA, where the CPU tests cannot go:

* FSDP1 with `CPUOffload(offload_params=True)` (FSDP1 cannot initialise it on a CPU-only
  torch), with and without `MixedPrecision(param_dtype=bf16)`;
* FSDP2 with `MixedPrecisionPolicy(param_dtype=bf16)` over NCCL: default resharding (the
  root stays unsharded after forward), `reshard_after_forward=False`, and `CPUOffloadPolicy`
  (CPU shards on a CUDA mesh).

Each in three states: fresh, after an AdamW step and a no_grad forward (a log-prob pass
before the weight sync), and after a forward whose backward has not run yet (then the
backward). LoRA (whole and layered) and base collections must be fp32, whole, on the CPU,
owning their storage, rank-identical and equal to the fp32 master parameters, read before
the forward while everything is sharded (FSDP2: `full_tensor()` of the parameters; FSDP1:
its full state dict).

    python scripts/gpu_check_fsdp.py    # 2+ GPUs: 2 NCCL processes; 1 GPU: world size 1
    python scripts/gpu_check_fsdp.py --cpu    # the FSDP2 cases on 2 gloo CPU processes
                                              # (a check of this script, no GPU needed)

Prints one JSON line; exits 1 if a check failed, 0 if all passed or when no GPU is
visible ("skipped: no CUDA").
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import traceback
import warnings
from datetime import timedelta

import torch

TARGETS = ["to_q", "to_k", "to_v", "to_out.0", "proj_out"]  # proj_out: root-level LoRA
CASES = ("fsdp1_offload", "fsdp1_offload_mp", "fsdp2_mp", "fsdp2_mp_keep", "fsdp2_mp_offload")
STATES = ("fresh", "nograd_fwd", "grad_fwd")


def _model():
    from peft import LoraConfig

    from omni.models.sd3 import build_tiny_transformer

    model = build_tiny_transformer(seed=0)
    torch.manual_seed(1)
    # init_lora_weights=False: random lora_B too, so every LoRA tensor is a real value
    model.add_adapter(LoraConfig(r=4, lora_alpha=8, target_modules=TARGETS, init_lora_weights=False))
    return model


def _inputs(device):
    g = torch.Generator().manual_seed(7)
    inputs = dict(
        hidden_states=torch.randn(1, 4, 8, 8, generator=g), encoder_hidden_states=torch.randn(1, 6, 64, generator=g),
        pooled_projections=torch.randn(1, 64, generator=g), timestep=torch.tensor([3.0]),
    )  # fmt: skip
    return {k: v.to(device) for k, v in inputs.items()}


def _blocks(model):
    return [m for n, m in model.named_modules() if n.startswith("transformer_blocks.") and n.count(".") == 1]


def _wrap(model, case, device):
    if case.startswith("fsdp1"):
        from torch.distributed.fsdp import CPUOffload, MixedPrecision
        from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
        from torch.distributed.fsdp.wrap import ModuleWrapPolicy

        mp = MixedPrecision(param_dtype=torch.bfloat16) if case.endswith("_mp") else None
        return FSDP(
            model, auto_wrap_policy=ModuleWrapPolicy({type(_blocks(model)[0])}), use_orig_params=True,
            cpu_offload=CPUOffload(offload_params=True), mixed_precision=mp, device_id=device,
        )  # fmt: skip
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard

    options = {
        "mesh": init_device_mesh(device.type, (torch.distributed.get_world_size(),)),
        "mp_policy": MixedPrecisionPolicy(param_dtype=torch.bfloat16),
    }
    if case.endswith("_keep"):
        options["reshard_after_forward"] = False
    if case.endswith("_offload"):
        options["offload_policy"] = CPUOffloadPolicy(pin_memory=False)
    model.to(device)
    for block in _blocks(model):
        fully_shard(block, **options)
    return fully_shard(model, **options)


def _masters(model, case) -> dict:
    """Whole fp32 CPU copies of the master parameters (unwrapped names), read through torch's
    own APIs while every parameter is sharded."""
    if case.startswith("fsdp1"):
        from torch.distributed.fsdp import FullStateDictConfig, StateDictType
        from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

        config = FullStateDictConfig(offload_to_cpu=False, rank0_only=False)  # tiny model: gathered on the GPU
        with FSDP.state_dict_type(model, StateDictType.FULL_STATE_DICT, config):
            state = model.state_dict()
        return {k.replace("_fsdp_wrapped_module.", ""): v.detach().cpu().clone() for k, v in state.items()}
    from torch.distributed.tensor import DTensor

    masters = {}
    for name, p in model.named_parameters():
        if not isinstance(p, DTensor):
            raise AssertionError(f"check precondition: {name} is not sharded")
        p = p.detach()
        masters[name] = p.to(p.device_mesh.device_type).full_tensor().cpu()
    return masters


def _reference(masters: dict):
    """The unwrapped model holding the masters: expected LoRA (PEFT names) and base tensors."""
    from peft import get_peft_model_state_dict

    from omni.models.sd3 import build_tiny_transformer

    ref = _model()
    params = dict(ref.named_parameters())
    missing = sorted(params.keys() - masters.keys())
    if missing:
        raise AssertionError(f"check precondition: masters lack {missing[:3]}")
    with torch.no_grad():
        for name, p in params.items():
            p.copy_(masters[name])
    return get_peft_model_state_dict(ref), build_tiny_transformer(seed=0).state_dict()  # LoRA freezes the base


def _problems(what, got: dict, expected: dict) -> list[str]:
    from torch.distributed.tensor import DTensor

    out = []
    if got.keys() != expected.keys():
        out.append(f"{what}: keys differ: {sorted(got.keys() ^ expected.keys())[:4]}")
    for key in sorted(got.keys() & expected.keys()):
        t, e = got[key], expected[key]
        if isinstance(t, DTensor) or t.device.type != "cpu":
            out.append(f"{what}: {key}: {type(t).__name__} on {t.device}")
        elif t.dtype != torch.float32:
            out.append(f"{what}: {key}: {t.dtype}, max error {(t.double() - e.double()).abs().max().item():.1e}")
        elif t.shape != e.shape:
            out.append(f"{what}: {key}: shape {tuple(t.shape)}, expected {tuple(e.shape)}")
        elif t.untyped_storage().nbytes() != t.numel() * t.element_size() or t.storage_offset() != 0:
            out.append(f"{what}: {key}: does not own its storage")
        elif not torch.equal(t, e):
            out.append(f"{what}: {key}: max error {(t.double() - e.double()).abs().max().item():.1e}")
    return out


def _digest(state: dict) -> str:
    import hashlib

    h = hashlib.sha1()
    for key, t in state.items():
        h.update(key.encode())
        h.update(t.reshape(-1).contiguous().view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def _check(case, state, device) -> dict:
    from omni.fsdp_utils import collect_lora_params

    model = _wrap(_model(), case, device)
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    pending = None
    if state == "nograd_fwd":
        model(**_inputs(device), return_dict=False)[0].pow(2).mean().backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    masters = _masters(model, case)
    expected_lora, expected_base = _reference(masters)
    if state == "nograd_fwd":
        with torch.no_grad():
            model(**_inputs(device), return_dict=False)
    elif state == "grad_fwd":
        pending = model(**_inputs(device), return_dict=False)[0]
    problems, digests = [], {}
    for what, layered, synced in (("lora", False, True), ("lora_layered", True, True), ("base", False, False)):
        got = collect_lora_params(model, layered, synced)
        problems += _problems(what, got, expected_lora if synced else expected_base)
        digests[what] = _digest(got)
    if pending is not None:  # the backward still works after the collection
        pending.pow(2).mean().backward()
    return {"problems": problems, "digests": digests}


def _worker(rank: int, world: int, out_dir: str, device_type: str, cases: list[str]) -> None:
    import torch.distributed as dist

    warnings.filterwarnings("ignore")
    # rendezvous through a file, not a port picked in advance: another process can take such a
    # port between the pick and the bind, which failed this check once on a busy machine
    group = dict(rank=rank, world_size=world, timeout=timedelta(seconds=300),
                 init_method=f"file://{os.path.join(out_dir, 'rendezvous')}")  # fmt: skip
    if device_type == "cuda":
        torch.cuda.set_device(rank)
        device = torch.device("cuda", rank)
        dist.init_process_group("nccl", device_id=device, **group)
    else:
        device = torch.device("cpu")
        torch.set_num_threads(1)
        dist.init_process_group("gloo", **group)
    results = {}
    try:
        for case in cases:
            for state in STATES:
                try:
                    results[f"{case}-{state}"] = _check(case, state, device)
                except Exception as e:  # noqa: BLE001 - reported per check
                    tb = traceback.format_exc(limit=-3).replace("\n", " | ")
                    results[f"{case}-{state}"] = {"problems": [f"{type(e).__name__}: {e} [{tb}]"], "digests": {}}
                dist.barrier()
    finally:
        with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
            json.dump(results, f)
        dist.destroy_process_group()


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cpu", action="store_true", help="run the FSDP2 cases on 2 gloo CPU processes")
    args = parser.parse_args(argv)
    summary = {"check": "gpu_check_fsdp", "torch": torch.__version__}
    if args.cpu:
        device_type, world, cases = "cpu", 2, [c for c in CASES if c.startswith("fsdp2")]
    elif not torch.cuda.is_available():
        print(json.dumps({**summary, "result": "skipped: no CUDA", "passed": None}))
        return 0
    else:
        device_type, world, cases = "cuda", min(2, torch.cuda.device_count()), list(CASES)
        summary["gpu"] = torch.cuda.get_device_name(0)
    summary["world_size"] = world
    with tempfile.TemporaryDirectory() as out_dir:
        try:
            torch.multiprocessing.start_processes(
                _worker, args=(world, out_dir, device_type, cases), nprocs=world, start_method="spawn"
            )
            per_rank = []
            for r in range(world):
                with open(os.path.join(out_dir, f"rank{r}.json")) as f:
                    per_rank.append(json.load(f))
        except Exception as e:  # noqa: BLE001 - a worker died: report it as the result
            print(json.dumps({**summary, "result": "error", "passed": False, "error": f"{type(e).__name__}: {e}"}))
            return 1
    checks = {}
    for key in (f"{c}-{s}" for c in cases for s in STATES):
        first = per_rank[0].get(key, {"problems": ["no result"], "digests": None})
        problems = list(first["problems"])
        if any(r.get(key, {}).get("digests") != first["digests"] for r in per_rank[1:]):
            problems.append("ranks returned different tensors")
        checks[key] = "ok" if not problems else problems[:6]
    passed = all(v == "ok" for v in checks.values())
    print(json.dumps({**summary, "result": "passed" if passed else "failed", "passed": passed, "checks": checks}))
    return 0 if passed else 1


if __name__ == "__main__":
    sys.exit(main())
