"""Text conditioning is encoded once per prompt and reused, with the same values."""

import torch

from omni.models.sd3 import FAMILY
from omni.rollout.sampling import PromptCache


def count_encoder_calls(pipe) -> list:
    calls = []
    for name in FAMILY.text_encoders:
        getattr(pipe, name).register_forward_hook(lambda module, args, out: calls.append(len(args[0]) if args else 0))
    return calls


def assert_same(a, b):
    assert a.field_names() == b.field_names()
    for name in a.field_names():
        x, y = getattr(a, name), getattr(b, name)
        assert (x is None) == (y is None)
        if x is not None:
            assert torch.equal(x, y), name


def test_each_prompt_is_encoded_once_and_rows_follow_the_prompts(diffusers_engine):
    pipe = diffusers_engine.pipe
    cache = PromptCache(FAMILY, pipe, "cpu", offload=True)
    calls = count_encoder_calls(pipe)
    prompts = ["a red cat", "a red cat", "a blue dog"]
    first = cache.encode(prompts, 4.5, 16)
    assert cache.encoded == 2 and calls  # the group's repeated prompt is encoded once
    direct = FAMILY.encode_prompts(pipe, prompts, 4.5, 16, "cpu")
    assert_same(first, direct)

    calls.clear()
    again = cache.encode(["a blue dog", "a red cat", "a blue dog"], 4.5, 16)
    assert calls == [] and cache.encoded == 2  # all cached: no encoder ran
    assert_same(again, FAMILY.encode_prompts(pipe, ["a blue dog", "a red cat", "a blue dog"], 4.5, 16, "cpu"))

    without_cfg = cache.encode(["a red cat"], 1.0, 16)  # other options are other entries
    assert cache.encoded == 3 and without_cfg.neg_embeds is None


def test_least_recently_used_prompts_are_dropped(diffusers_engine):
    cache = PromptCache(FAMILY, diffusers_engine.pipe, "cpu", offload=False, size=2)
    cache.encode(["a red cat", "a blue dog"], 1.0, 16)
    cache.encode(["a red cat"], 1.0, 16)  # the cat is now the most recent
    cache.encode(["a green tree"], 1.0, 16)
    assert [key[0] for key in cache.rows] == ["a red cat", "a green tree"]
    cache.encode(["a blue dog"], 1.0, 16)
    assert cache.encoded == 4


def test_one_instruction_on_two_sources_is_two_entries(diffusers_engine):
    """An edit's conditioning depends on its source images: the same instruction on another
    source is encoded again, on the same source it is reused."""
    from omni.data.prompts import Prompt

    cache = PromptCache(FAMILY, diffusers_engine.pipe, "cpu", offload=False)
    on_a, on_b = Prompt("make it red", images=["a.png"]), Prompt("make it red", images=["b.png"])
    cache.encode([on_a, on_b, Prompt("make it red", images=["a.png"])], 1.0, 16)
    assert cache.encoded == 2
    cache.encode(["make it red"], 1.0, 16)  # the text alone is a third entry
    assert cache.encoded == 3
