"""The actor's process group: NCCL bound to the worker's GPU with a timeout, gloo on CPU."""

import torch
import torch.distributed as dist

from omni import distributed


def test_nccl_group_gets_its_device_and_a_timeout(monkeypatch):
    calls = []
    monkeypatch.setattr(dist, "is_initialized", lambda: False)
    monkeypatch.setattr(dist, "init_process_group", lambda *args, **kwargs: calls.append((args, kwargs)))
    distributed.init_process_group(1, 2, torch.device("cuda", 1))
    distributed.init_process_group(0, 2, torch.device("cpu"))
    (nccl_args, nccl), (gloo_args, gloo) = calls
    assert (
        nccl_args == ("nccl",)
        and nccl["device_id"] == torch.device("cuda", 1)
        and nccl["timeout"] == distributed.COLLECTIVE_TIMEOUT
    )
    assert gloo_args == ("gloo",) and "device_id" not in gloo and gloo["timeout"] == distributed.COLLECTIVE_TIMEOUT
