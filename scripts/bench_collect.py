"""Benchmark omni.fsdp_utils.collect_lora_params: peak extra memory and time, layered or not.

Two CPU ranks (gloo) shard a ~110M-parameter, 12-block SD3-shaped transformer (fp32, LoRA
rank 16 on the attention projections and `proj_out`) with FSDP1 (per-block wrap; LoRA-aware
wrap) and FSDP2 (`fully_shard` per block + root), then time the base sync and the LoRA sync
with and without `layered_summon`. Peak extra memory is the resident set (VmRSS, sampled by
a thread) above what it was just before the call, per rank. Prints one JSON object.

Targets: layered peak extra <= 1.5 x one block's full size; the LoRA sync returns no more
than the LoRA bytes.

    python scripts/bench_collect.py [--layers 12] [--heads 8] [--rank 16]
"""

from __future__ import annotations

import argparse
import ctypes
import gc
import json
import os
import tempfile
import threading
import time
import warnings
from datetime import timedelta

import torch
import torch.distributed as dist

from omni.distributed import free_port
from omni.fsdp_utils import state_nbytes

WORLD = 2
TARGETS = ["to_q", "to_k", "to_v", "to_out.0", "proj_out"]
WRAPPINGS = ("fsdp1_blocks", "fsdp1_lora_aware", "fsdp2")


def _rss() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("no VmRSS in /proc/self/status")


def _trim() -> None:
    """Give freed heap memory back to the OS so the next baseline is honest."""
    gc.collect()
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except OSError:
        pass


class PeakRss:
    """Highest VmRSS seen while the block runs, sampled every `interval` seconds."""

    def __init__(self, interval: float = 0.0005):
        self.interval, self.baseline, self.peak = interval, 0, 0
        self._stop = threading.Event()

    def _sample(self) -> None:
        while not self._stop.is_set():
            self.peak = max(self.peak, _rss())
            time.sleep(self.interval)

    def __enter__(self):
        self.baseline = self.peak = _rss()
        self._thread = threading.Thread(target=self._sample, daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, _rss())

    @property
    def extra(self) -> int:
        return self.peak - self.baseline


def _build(args):
    from peft import LoraConfig

    from omni.models.sd3 import build_tiny_transformer

    dim = 64 * args.heads
    model = build_tiny_transformer(
        seed=0, num_layers=args.layers, attention_head_dim=64, num_attention_heads=args.heads,
        joint_attention_dim=dim, caption_projection_dim=dim, pooled_projection_dim=dim,
    )  # fmt: skip
    config = LoraConfig(r=args.rank, lora_alpha=args.rank, target_modules=TARGETS, init_lora_weights=False)
    model.add_adapter(config, adapter_name="default")
    return model


def _sizes(model) -> dict:
    return {
        "params": sum(p.numel() for p in model.parameters()),
        "block_bytes": state_nbytes(model.transformer_blocks[0].parameters()),
        "lora_bytes": state_nbytes(p for n, p in model.named_parameters() if ".lora_" in n),
        "model_bytes": state_nbytes([*model.parameters(), *model.buffers()]),
    }


def _wrap(model, wrapping):
    from diffusers.models.attention import JointTransformerBlock
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
    from torch.distributed.fsdp.wrap import CustomPolicy, ModuleWrapPolicy

    cpu = torch.device("cpu")
    if wrapping == "fsdp1_blocks":
        policy = ModuleWrapPolicy({JointTransformerBlock})
        return FSDP(model, auto_wrap_policy=policy, use_orig_params=True, device_id=cpu)
    if wrapping == "fsdp1_lora_aware":

        def lora_or_block(m):
            trainable = any(p.requires_grad for p in m.parameters(recurse=False))
            return isinstance(m, JointTransformerBlock) or (not list(m.children()) and trainable)

        return FSDP(model, auto_wrap_policy=CustomPolicy(lora_or_block), use_orig_params=False, device_id=cpu)
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (WORLD,))
    for block in model.transformer_blocks:
        fully_shard(block, mesh=mesh)
    return fully_shard(model, mesh=mesh)


def _measure(fn) -> dict:

    _trim()
    dist.barrier()
    with PeakRss() as mem:
        start = time.perf_counter()
        out = fn()
        seconds = time.perf_counter() - start
    result = {"seconds": seconds, "peak_extra_bytes": mem.extra, "returned_bytes": state_nbytes(out)}
    result["tensors"] = len(out)
    del out
    _trim()
    return result


def _gather_one_block(block_numel: int) -> int:
    """Peak extra RSS of one raw all-gather producing a block-sized tensor: what gathering
    one FSDP unit costs on this backend (gloo stages the output in a second buffer)."""
    shard = torch.ones(block_numel // WORLD)
    _trim()
    dist.barrier()
    with PeakRss() as mem:
        out = torch.empty(shard.numel() * WORLD)
        dist.all_gather_into_tensor(out, shard)
    del out
    _trim()
    return mem.extra


def _bench_wrapping(args, wrapping) -> dict:
    from omni.fsdp_utils import collect_lora_params

    model = _wrap(_build(args), wrapping)
    _trim()
    runs = {
        "base_full": _measure(lambda: collect_lora_params(model, False, False)),
        "lora_full": _measure(lambda: collect_lora_params(model, False, True)),
        "lora_layered": _measure(lambda: collect_lora_params(model, True, True)),
    }
    model = None  # release the wrapped model before the next wrapping is measured
    _trim()
    return runs


def _worker(rank: int, port: int, args, block_numel: int, out_path: str) -> None:
    warnings.filterwarnings("ignore")
    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=WORLD, timeout=timedelta(seconds=300))
    try:
        mine = {w: _bench_wrapping(args, w) for w in WRAPPINGS}
        mine["gather_one_block"] = _gather_one_block(block_numel)
        everyone = [None] * WORLD
        dist.all_gather_object(everyone, mine)
        if rank == 0:
            with open(out_path, "w") as f:
                json.dump(everyone, f)
    finally:
        dist.destroy_process_group()


def _combine(per_rank: list[dict], sizes: dict) -> dict:
    runs, targets = {}, {}
    one_block = max(r["gather_one_block"] for r in per_rank)
    for w in WRAPPINGS:
        runs[w] = {}
        for name in per_rank[0][w]:
            cells = [r[w][name] for r in per_rank]
            peaks = [c["peak_extra_bytes"] for c in cells]
            runs[w][name] = {
                "seconds_max": round(max(c["seconds"] for c in cells), 3),
                "peak_extra_bytes_per_rank": peaks,
                "peak_extra_bytes_max": max(peaks),
                "returned_bytes": cells[0]["returned_bytes"],
                "tensors": cells[0]["tensors"],
            }
        layered_peak = runs[w]["lora_layered"]["peak_extra_bytes_max"]
        lora_returned = max(runs[w][n]["returned_bytes"] for n in ("lora_full", "lora_layered"))
        targets[w] = {
            "layered_peak_extra_le_1.5x_block": layered_peak <= 1.5 * sizes["block_bytes"],
            "layered_peak_extra_le_1.1x_gather_one_block": layered_peak <= 1.1 * one_block,
            "lora_returned_le_lora_bytes": lora_returned <= sizes["lora_bytes"],
        }
    return {"gather_one_block_peak_extra_bytes_max": one_block, "runs": runs, "targets": targets}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--layers", type=int, default=12)
    parser.add_argument("--heads", type=int, default=8, help="attention heads of 64 dims (8 -> width 512)")
    parser.add_argument("--rank", type=int, default=16, help="LoRA rank")
    args = parser.parse_args()

    warnings.filterwarnings("ignore")
    sizes = _sizes(_build(args))
    # Spawned workers inherit these: one thread each, and large tensors always mmapped so
    # freeing them lowers RSS at once (glibc's adaptive threshold would keep them in the heap).
    os.environ.update(OMP_NUM_THREADS="1", MALLOC_MMAP_THRESHOLD_="65536")
    start = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        out_path = os.path.join(tmp, "per_rank.json")
        worker_args = (free_port(), args, sizes["block_bytes"] // 4, out_path)
        torch.multiprocessing.start_processes(_worker, args=worker_args, nprocs=WORLD, start_method="spawn")
        with open(out_path) as f:
            per_rank = json.load(f)
    model = {"blocks": args.layers, "width": 64 * args.heads, "lora_rank": args.rank, "dtype": "float32"}
    model["world"] = WORLD
    report = {"model": {**model, **sizes}, **_combine(per_rank, sizes)}
    report["total_seconds"] = round(time.perf_counter() - start, 1)
    print(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
