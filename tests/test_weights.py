"""PEFT names with and without the adapter name map onto each other exactly."""

import torch

from omni.config.model import LoraConfig
from omni.models.sd3 import FAMILY, build_tiny_transformer
from omni.weights import add_lora_adapter, load_lora_weights, lora_tensors, module_lora_names

TARGETS = list(FAMILY.lora_targets)


def test_adapter_names_round_trip():
    model = build_tiny_transformer()
    add_lora_adapter(model, LoraConfig(adapter_name="policy", target_modules=TARGETS))
    peft_named = lora_tensors(model, "policy")
    assert peft_named and all(".policy." not in k for k in peft_named)
    module_named = module_lora_names(peft_named, "policy")
    own = {n for n, _ in model.named_parameters() if ".policy." in n}
    assert set(module_named) == own


def test_load_is_strict_and_exact():
    model = build_tiny_transformer()
    add_lora_adapter(model, LoraConfig(target_modules=TARGETS))
    values = {k: torch.randn_like(v) for k, v in lora_tensors(model, "default").items()}
    load_lora_weights(model, values, "default")
    assert all(torch.equal(lora_tensors(model, "default")[k], v) for k, v in values.items())
    missing_one = dict(list(values.items())[1:])
    try:
        load_lora_weights(model, missing_one, "default")
    except KeyError as error:
        assert "1 missing" in str(error)
    else:
        raise AssertionError("a missing LoRA tensor was accepted")
