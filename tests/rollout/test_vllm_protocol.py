"""An edit's source images on their way to the engine (`omni.rollout.vllm_protocol`): their
files travel beside the prompts' texts, the engine gives the prompts their sources back, and
each request carries its sources opened as RGB in `multi_modal_data`, where vLLM-Omni's edit
pipelines read them (its real FluxKontextPipeline does: tests/rollout/test_vllm_cpu_smoke.py)."""

import pytest
from PIL import Image

from omni.data.prompts import Prompt, source_images
from omni.rollout.vllm_protocol import prompt_sources, request_inputs, with_sources
from tests.rollout.conftest import options


@pytest.fixture
def edit_prompts(tmp_path):
    paths = []
    for i, colour in enumerate(((255, 0, 0, 128), (0, 0, 255, 255))):
        paths.append(tmp_path / f"source{i}.png")
        Image.new("RGBA", (24, 16), colour).save(paths[-1])
    return [Prompt("make it green", images=[str(paths[0])]), Prompt("make it red", images=[str(paths[1])])]


def test_sources_travel_beside_the_texts_and_come_back(edit_prompts):
    sources = prompt_sources(edit_prompts)
    assert sources == [[p.images[0]] for p in edit_prompts]
    back = with_sources([str(p) for p in edit_prompts], sources)
    assert back == edit_prompts and [source_images(p) for p in back] == [p.images for p in edit_prompts]
    assert with_sources(["a cat"], prompt_sources(["a cat"])) == ["a cat"]
    with pytest.raises(ValueError, match="2 prompts but 1 lists of source images"):
        with_sources([str(p) for p in edit_prompts], sources[:1])


def test_an_edit_request_carries_its_sources_as_rgb_images(edit_prompts):
    text, sampling = request_inputs(edit_prompts[0], 7, options())
    assert text["prompt"] == "make it green" and sampling["seed"] == 7
    (image,) = text["multi_modal_data"]["image"]
    assert image.mode == "RGB" and image.size == (24, 16) and image.getpixel((0, 0)) == (255, 0, 0)
    plain, _ = request_inputs("a cat", 7, options())
    assert plain == {"prompt": "a cat"}


def test_an_unreadable_source_is_named(tmp_path):
    missing = Prompt("make it green", images=[str(tmp_path / "gone.png")], origin="edits.jsonl, line 3")
    with pytest.raises(ValueError, match="edits.jsonl, line 3: image .*gone.png cannot be read"):
        request_inputs(missing, 0, options())


def test_requests_hold_a_prompt_group_and_a_forward_keeps_its_image_count():
    """`--requests per_group`: runs of equal prompts (text and sources) become one request of
    up to `--group-size` images, so vLLM-Omni takes `--max-num-seqs` over that many requests a
    forward; vLLM-Omni's SD3, which does not repeat its text per output, gets one image a request."""
    from omni.rollout.vllm_protocol import prompt_groups
    from omni.rollout.vllm_server import max_num_seqs, parse_args, request_size

    sourced = Prompt("a cat", images=["a.png"])
    groups = prompt_groups(["a cat"] * 3 + [sourced, "a dog", "a cat"], [1, 2, 3, 4, 5, 6], size=2)
    assert [(str(p), s) for p, s in groups] == [
        ("a cat", [1, 2]), ("a cat", [3]), ("a cat", [4]), ("a dog", [5]), ("a cat", [6]),
    ]  # fmt: skip
    assert source_images(groups[2][0]) == ("a.png",)
    base = ["--model", "m", "--max-num-seqs", "8", "--group-size", "4"]
    grouped, single = parse_args(base), parse_args([*base, "--requests", "per_image"])
    assert (request_size(grouped), max_num_seqs(grouped)) == (4, 2)
    assert (request_size(single), max_num_seqs(single)) == (1, 8)
    assert request_size(parse_args([*base, "--backend", "native", "--family", "sd3"])) == 1
    assert request_size(parse_args([*base, "--backend", "native", "--family", "flux"])) == 4
