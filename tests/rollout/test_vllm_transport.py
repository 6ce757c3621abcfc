"""The driver <-> engine transport: messages and weight directories cross bit-exact, weight
directories appear atomically, and the receiving pipeline loads them into its transformer."""

import json

import pytest
import torch
from safetensors.torch import load_file

from omni.models.sd3 import build_tiny_transformer
from omni.rollout import transport
from omni.rollout.vllm_pipeline import FlowGRPOPipeline
from omni.weights import lora_tensors, plain_base_names
from tests.rollout.conftest import LORA, od_config, random_lora


def assert_bit_exact(got, expected):
    assert set(got) == set(expected)
    for name, tensor in expected.items():
        assert got[name].dtype == tensor.dtype and got[name].shape == tensor.shape, name
        assert torch.equal(got[name].view(torch.uint8), tensor.contiguous().view(torch.uint8)), name


def test_message_round_trip_is_bit_exact():
    tensors = {
        "bf16": torch.randn(3, 5).to(torch.bfloat16),
        "f32": torch.randn(2, 7)[:, ::2],  # not contiguous
        "i64": torch.arange(4),
        "nan": torch.tensor([float("nan"), -0.0, float("inf")]),
    }
    meta = {"prompts": ["a red cat"], "options": {"sde_steps": [1, 3]}}
    got, got_meta = transport.unpack(transport.pack(tensors, meta))
    assert got_meta == meta
    assert_bit_exact(got, tensors)


def test_base_weights_round_trip_bit_exact(tmp_path):
    source = {k: v.detach().to(torch.bfloat16) for k, v in plain_base_names(build_tiny_transformer(seed=1)).items()}
    path = transport.write_base_weights(tmp_path, "base-000001", source)
    kind, tensors, lora = transport.read_weights(path)
    assert (kind, lora) == ("base", None)
    assert_bit_exact(tensors, source)


def test_lora_is_a_peft_adapter_directory(tmp_path):
    from peft import PeftModel

    source = random_lora(build_tiny_transformer())
    path = transport.write_lora_adapter(tmp_path, "lora-000001", source, LORA)
    assert {p.name for p in path.iterdir()} >= {"adapter_model.safetensors", "adapter_config.json"}
    config = json.loads((path / "adapter_config.json").read_text())
    assert (config["peft_type"], config["r"], config["lora_alpha"]) == ("LORA", LORA.rank, LORA.alpha)
    kind, tensors, lora = transport.read_weights(path)
    assert kind == "lora" and lora.rank == LORA.rank and lora.adapter_name == LORA.adapter_name
    assert_bit_exact(tensors, source)
    # PEFT itself loads the directory onto a plain transformer, with the same values
    model = PeftModel.from_pretrained(build_tiny_transformer(), str(path))
    assert_bit_exact({k: v.detach() for k, v in lora_tensors(model.base_model.model, "default").items()}, source)


def test_weight_directory_is_replaced_whole(tmp_path):
    first = transport.write_base_weights(tmp_path, "base-000001", {"w": torch.zeros(2)})
    again = transport.write_base_weights(tmp_path, "base-000001", {"w": torch.ones(2)})
    assert first == again and [p.name for p in tmp_path.iterdir()] == ["base-000001"]
    assert torch.equal(load_file(str(again / "model.safetensors"))["w"], torch.ones(2))


def test_tensors_sharing_storage_are_written_separately(tmp_path):
    weight = torch.randn(4, 4)
    path = transport.write_base_weights(tmp_path, "base", {"a": weight, "b": weight, "c": weight[1]})
    _, tensors, _ = transport.read_weights(path)
    assert_bit_exact(tensors, {"a": weight, "b": weight, "c": weight[1]})


def test_engine_pipeline_loads_synced_weights_bit_exact(tiny_sd3_dir, tmp_path):
    """The receiving side: a pipeline started without base weights gets them, then a LoRA."""
    pipeline = FlowGRPOPipeline(od_config=od_config(tiny_sd3_dir, load_base=False))
    assert not pipeline.has_base
    trained = build_tiny_transformer(seed=7)
    base = {k: v.detach() for k, v in plain_base_names(trained).items()}
    with pytest.raises(RuntimeError, match="before any base weights"):
        pipeline.sync_weights_from(transport.write_lora_adapter(tmp_path, "lora-0", random_lora(trained), LORA))

    answer = pipeline.sync_weights_from(transport.write_base_weights(tmp_path, "base-1", base))
    assert answer == {"kind": "base", "tensors": len(base), "has_base": True}
    assert_bit_exact({k: v.detach() for k, v in plain_base_names(pipeline.transformer).items()}, base)

    lora = random_lora(trained, seed=3)
    pipeline.sync_weights_from(transport.write_lora_adapter(tmp_path, "lora-2", lora, LORA))
    assert_bit_exact({k: v.detach() for k, v in lora_tensors(pipeline.transformer, LORA.adapter_name).items()}, lora)
    later = random_lora(trained, seed=4)  # later syncs overwrite the same adapter
    pipeline.sync_weights_from(transport.write_lora_adapter(tmp_path, "lora-3", later, LORA))
    assert_bit_exact({k: v.detach() for k, v in lora_tensors(pipeline.transformer, LORA.adapter_name).items()}, later)
