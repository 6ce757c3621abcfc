"""Tests for omni.fsdp_utils: collecting LoRA/base weights from plain, FSDP1 and FSDP2 models.

The distributed cells (tests/fsdp_cells.py, on the models of tests/fsdp_models.py) run on
CPU in one real 2-process gloo group, started once for the whole module: every wrapping x
layered x base_sync_done x adapter case x {fresh, after an AdamW step} cell, the error cells
and the summon cells run there, each rank records its findings per cell in a JSON file, and
the parametrized tests below assert on them (the cell's checks, and that all ranks returned
bit-identical tensors). The cells that need 4 ranks run the same way in a 4-process group.
One cell runs a whole ActorRolloutWorker on the tiny Wan in the 2-process group (the actor
under FSDP2): the LoRA sync is exact at the worker's level, the actor's log-probs those of
the engine (the Ray group test runs the other families' workers, in their own processes).

References are the same models unwrapped (same seeds, same optimizer step on the same
batch, so FSDP's averaged gradient equals the plain one): `peft.get_peft_model_state_dict`
of the reference for LoRA, the plain transformer's `state_dict()` for base weights (LoRA
freezes the base, so training does not change it).

FSDP2 mixed precision (bf16 compute, fp32 master parameters) gets its own cells, in the
states where FSDP2 leaves modules unsharded with bf16 compute copies registered (after a
no_grad forward, between a forward and its backward; the root by default, every block with
`reshard_after_forward=False`), with CPU offload, and on 4 ranks with HSDP (2 x 2 mesh) and
a partial post-forward reshard. Their reference is the fp32 masters, read (`full_tensor()`)
while every parameter is sharded, copied into an unwrapped model.
"""

from __future__ import annotations

import json
import os

import pytest
import torch
from torch import nn

from omni.distributed import free_port
from tests import cli_process
from tests.fsdp_cells import CELLS, cell_world, worker
from tests.fsdp_models import build_sd3, lora_config, with_adapters

# What every worker imports, imported once by the forkserver that forks them (instead of
# in each spawned process: peft alone takes seconds, 4 processes share 2 cores here).
_WORKER_PRELOAD = [
    "tests.fsdp_cells",
    *cli_process.PRELOAD,  # the server is shared with tests/cli_process.py's runs: their imports too
    "omni.fsdp_utils",
    "omni.models.sd3",
    "torch.distributed.fsdp",
    "diffusers.models.transformers.transformer_sd3",
    "diffusers.models.transformers.transformer_flux",
    "diffusers.models.transformers.transformer_wan",
    "omni.workers.actor_rollout",
    "omni.algorithms.flow_grpo",
    "tests.conftest",
]


def _run_group(world: int, out_dir, wan_dir) -> list[dict]:
    import multiprocessing

    saved = os.environ.get("OMP_NUM_THREADS")
    os.environ["OMP_NUM_THREADS"] = "1"  # inherited by the forkserver, started on first use
    multiprocessing.get_context("forkserver").set_forkserver_preload(_WORKER_PRELOAD)
    try:
        torch.multiprocessing.start_processes(
            worker,
            args=(world, free_port(), str(out_dir), str(wan_dir)),
            nprocs=world,
            start_method="forkserver",
            join=True,
        )
    finally:
        if saved is None:
            os.environ.pop("OMP_NUM_THREADS")
        else:
            os.environ["OMP_NUM_THREADS"] = saved
    return [json.loads((out_dir / f"rank{r}.json").read_text()) for r in range(world)]


@pytest.fixture(scope="module")
def results(tmp_path_factory, tiny_wan_dir):
    """world size -> each rank's cell results; each group is started once, when first needed."""
    groups: dict[int, list[dict]] = {}

    def of_world(world: int) -> list[dict]:
        if world not in groups:
            groups[world] = _run_group(world, tmp_path_factory.mktemp(f"fsdp_cells_{world}"), tiny_wan_dir)
        return groups[world]

    return of_world


@pytest.mark.parametrize("cell", list(CELLS))
def test_cell(results, cell):
    expect_error = CELLS[cell]
    per_rank = [r[cell] for r in results(cell_world(cell))]
    for rank, r in enumerate(per_rank):
        if expect_error:
            assert r["error"], f"rank {rank}: expected an error containing {expect_error}, got none"
            assert all(s in r["error"] for s in expect_error), f"rank {rank}: {r['error']!r} lacks {expect_error}"
        else:
            assert r["error"] is None, f"rank {rank}: {r['error']}"
            assert r["problems"] == [], f"rank {rank}: " + "\n".join(r["problems"])
    assert all(r["digests"] == per_rank[0]["digests"] for r in per_rank), "ranks returned different tensors"


def test_layered_summon_needs_base_sync_done_plain():
    from omni.fsdp_utils import collect_lora_params

    with pytest.raises(ValueError, match="base_sync_done"):
        collect_lora_params(with_adapters("sd3", ("default",)), layered_summon=True, base_sync_done=False)


def test_peft_inject_adapter_in_model_layout():
    """peft's own injection (no diffusers add_adapter, no peft_config on the model)."""
    from peft import inject_adapter_in_model

    from omni.fsdp_utils import collect_lora_params

    model = inject_adapter_in_model(lora_config(), build_sd3(0), adapter_name="policy")
    got = collect_lora_params(model, layered_summon=True, base_sync_done=True, adapter_name="policy")
    expected = {n.replace(".policy.", "."): p for n, p in model.named_parameters() if ".lora_" in n}
    assert got.keys() == expected.keys() and "proj_out.lora_B.weight" in got
    assert all(torch.equal(got[k], expected[k]) for k in got)
    base = collect_lora_params(model, layered_summon=False, base_sync_done=False)
    build_sd3(5).load_state_dict(base, strict=True)


def test_collecting_nothing_is_an_error():
    from omni.fsdp_utils import collect_lora_params

    with pytest.raises(ValueError, match=r"collected no base tensors.*adapter_name='default'.*transformer_blocks"):
        collect_lora_params(nn.Module(), layered_summon=False, base_sync_done=False)


def test_state_nbytes_counts_bytes():
    from omni.fsdp_utils import state_nbytes

    assert state_nbytes({"a": torch.zeros(3, 4), "b": torch.zeros(5, dtype=torch.float16)}) == 3 * 4 * 4 + 5 * 2


def test_summon_on_plain_module_is_a_no_op():
    from omni.fsdp_utils import fsdp_summon_full_params

    model = nn.Linear(3, 2)
    weight = model.weight
    with fsdp_summon_full_params(model, writeback=True, with_grads=True):
        assert model.weight is weight
