"""What every registered model family promises, checked on its tiny model: the parametrisation
comes from the registry itself, so a family is held to the whole contract by being registered.

- its tiny checkpoint is a function of the seed: built in another process, every file is the
  same to the byte, and another seed gives another transformer;
- it ships a real-weights config (`path: ???`) whose missing local path fails validation
  naming the key, before any model loads, and a tiny config (`tiny_seed`);
- our sampler's ODE images (clips for a video family) are its diffusers pipeline's for the
  same prompts, seeds and steps, with guidance off and on;
- a LoRA on the family's targets (in every block container), exported by our checkpoint path,
  loads into that pipeline with exactly the exported keys (none missing, none unexpected) and
  gives the pipeline's transformer our actor's velocity;
- the modules it reports unused are exactly those whose LoRA gets no gradient.
"""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
import torch
from omegaconf import OmegaConf

from omni.config import CONF_DIR
from omni.models import FAMILIES, get_family
from omni.rollout.base import SamplingOptions
from omni.rollout.sampling import sample_rollout
from tests.models.log_warnings import WarningMessages
from tests.models.qwen_edit_sizes import small_edit_sources  # noqa: F401 (autouse)

NAMES = FAMILIES.names()
# a tuple: ZImagePipeline rewrites a prompt list in place (its chat template), so each call gets a copy
PROMPTS = ("a red cat", "a blue dog with a tree")
SEEDS = [3, 4]
STEPS = 3  # text: each tiny config's max_sequence_length
# Guidance the contract samples with beside the tiny config's own: classifier-free guidance
# (or FLUX.1-dev's distilled guidance) at a scale every family takes.
GUIDED = 4.0


def model_configs(name: str):
    """(real-weights config names, tiny config names) of the family, from conf/model/."""
    real, tiny = [], []
    for path in sorted((Path(CONF_DIR) / "model").glob("*.yaml")):
        cfg = OmegaConf.load(path)
        if cfg.get("family") != name:
            continue
        if cfg.get("tiny_seed") is not None:
            tiny.append(path.stem)
        elif OmegaConf.is_missing(cfg, "path"):
            real.append(path.stem)
    return real, tiny


def tiny_settings(name: str) -> dict:
    return OmegaConf.to_container(OmegaConf.load(Path(CONF_DIR) / "model" / f"{model_configs(name)[1][0]}.yaml"))


def contract_prompts(family) -> list:
    """PROMPTS as the family takes them: an edit family's each with a source image (a
    deterministic random picture the size of the tiny model's output, two for the second
    prompt where the family takes several)."""
    if not family.edit:
        return list(PROMPTS)
    from PIL import Image

    from omni.data.prompts import Prompt

    root = Path(tempfile.gettempdir()) / f"omni-contract-sources-{os.getpid()}"
    root.mkdir(exist_ok=True)
    size = tiny_settings(family.name)["resolution"]
    generator = torch.Generator().manual_seed(11)
    prompts = []
    for i, text in enumerate(PROMPTS):
        paths = []
        for j in range(1 + (i if family.max_source_images > 1 else 0)):
            pixels = (torch.rand(size, size, 3, generator=generator) * 255).to(torch.uint8).numpy()
            paths.append(root / f"source-{i}-{j}.png")
            Image.fromarray(pixels).save(paths[-1])
        prompts.append(Prompt(text, origin=f"contract prompt {i}", images=paths))
    return prompts


def tiny_dir(name, tiny_cache) -> Path:
    return get_family(name).tiny_path(tiny_cache, 0)


_PIPES: dict = {}


def pipeline(name, tiny_cache):
    """The tiny pipeline, loaded once per test module."""
    if name not in _PIPES:
        pipe = get_family(name).load_pipeline(tiny_dir(name, tiny_cache), torch.float32)
        pipe.set_progress_bar_config(disable=True)
        _PIPES[name] = pipe
    return _PIPES[name]


def files(root: Path):
    return sorted(p.relative_to(root) for p in root.rglob("*") if p.is_file())


def test_the_registry_lists_every_family():
    assert {"sd3", "flux", "qwen_image", "wan"} <= set(NAMES)


@pytest.mark.parametrize("name", NAMES)
def test_tiny_build_is_a_function_of_the_seed(name, tiny_cache, tmp_path):
    """The session's build and one in another process are the same files to the byte (the
    tokenizers included); seed 1 gives another transformer."""
    ours = tiny_dir(name, tiny_cache)
    code = "import sys; from omni.models import get_family; get_family(sys.argv[1]).tiny_path(sys.argv[2], 0)"
    subprocess.run([sys.executable, "-c", code, name, str(tmp_path / "other")], check=True)
    (theirs,) = [p for p in (tmp_path / "other").iterdir() if p.is_dir()]
    assert files(ours) and files(ours) == files(theirs)
    assert {f.parts[0] for f in files(ours)} >= {"transformer", "vae", "scheduler", "tokenizer"}
    for f in files(ours):
        assert (ours / f).read_bytes() == (theirs / f).read_bytes(), f
    family = get_family(name)
    other = family.load_transformer(family.tiny_path(tmp_path / "seed1", 1), torch.float32).state_dict()
    base = family.load_transformer(ours, torch.float32).state_dict()
    assert other.keys() == base.keys() and any(not torch.equal(other[k], base[k]) for k in base)
    assert family.tiny_resolution_multiple() == family.resolution_multiple(ours)


@pytest.mark.parametrize("name", NAMES)
def test_missing_local_path_is_named_before_any_model_loads(name, tmp_path, monkeypatch):
    """The family's real-weights config with a directory that holds no checkpoint fails
    validation with the key and the path, before a transformer config or weights are read."""
    from omni.config.errors import ConfigError
    from omni.validation import validate
    from tests.conftest import compose_config

    real, tiny = model_configs(name)
    assert real and tiny, f"model family {name} needs a conf/model yaml with path: ??? and one with tiny_seed"
    family = get_family(name)

    def no_loading(*args, **kwargs):
        raise AssertionError("a model was read before the path was checked")

    for attribute in ("transformer_config", "load_transformer", "load_pipeline"):
        monkeypatch.setattr(family, attribute, no_loading)
    nowhere = tmp_path / "nowhere"
    with pytest.raises(ConfigError, match=rf"model.path={nowhere}.*model_index.json"):
        validate(compose_config([f"model={real[0]}", f"model.path={nowhere}"]))
    with pytest.raises(ValueError, match="pass model.path="):
        family.check_path(None)


def ode_sample(family, pipe, guidance_scale, settings):
    """Our sampler with every step an ODE step."""
    options = SamplingOptions(
        STEPS, settings["resolution"], guidance_scale, noise_level=0.7,
        max_sequence_length=settings["max_sequence_length"],
        sde_steps=(0, 0), num_frames=settings.get("num_frames", 1),
    )  # fmt: skip
    prompts = contract_prompts(family)
    return sample_rollout(family, pipe, prompts, SEEDS, options, 4, torch.device("cpu"), torch.float32)


def pipeline_output(family, pipe, guidance_scale, settings):
    """The plain pipeline's images (or clips) for the same prompts, generators and steps."""
    size = settings["resolution"]
    video = {"num_frames": settings["num_frames"]} if family.video else {}
    prompts = contract_prompts(family)
    # an edit pipeline takes a prompt's own sources: one call per prompt
    calls = [([p], [s]) for p, s in zip(prompts, SEEDS)] if family.edit else [(prompts, SEEDS)]
    outputs = []
    for batch, seeds in calls:
        # by keyword: Flux2KleinPipeline takes a conditioning image first
        out = pipe(
            prompt=[str(p) for p in batch], height=size, width=size, num_inference_steps=STEPS,
            max_sequence_length=settings["max_sequence_length"],
            generator=[torch.Generator().manual_seed(s) for s in seeds],
            output_type="pt", **video, **family.pipeline_guidance(guidance_scale),
            **family.pipeline_sources(batch, size),
        )  # fmt: skip
        outputs.append(out.frames if family.video else out.images)
    return torch.cat(outputs)


@pytest.mark.parametrize("guided", [False, True], ids=["tiny-guidance", "guided"])
@pytest.mark.parametrize("name", NAMES)
def test_ode_sampling_equals_the_diffusers_pipeline(name, guided, tiny_cache):
    family, settings = get_family(name), tiny_settings(name)
    pipe = pipeline(name, tiny_cache)
    guidance = GUIDED if guided else settings["guidance_scale"]
    ours = ode_sample(family, pipe, guidance, settings)
    theirs = pipeline_output(family, pipe, guidance, settings)
    assert ours.images.shape == theirs.shape and theirs.std() > 0.05
    assert (ours.images - theirs).abs().max() < 1e-5


def random_lora(family, path, exclude=()):
    """The tiny transformer with a LoRA on the family's targets, every LoRA weight random."""
    from omni.config.model import LoraConfig
    from omni.weights import add_lora_adapter

    config = LoraConfig(rank=4, target_modules=list(family.lora_targets), exclude_modules=list(exclude))
    actor = family.load_transformer(path, torch.float32)
    add_lora_adapter(actor, config)
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for parameter_name, p in actor.named_parameters():
            if "lora_" in parameter_name:
                p.copy_(torch.randn(p.shape, generator=generator) * 0.1)
    return actor, config


def velocity_inputs(family, pipe, settings, guidance):
    """Conditioning, initial latents (the sampler's own layout) and two noise levels."""
    text_length = settings["max_sequence_length"]
    cond = family.encode_prompts(pipe, contract_prompts(family), guidance, text_length, "cpu")
    cond = family.complete_conditioning(pipe, cond, settings["resolution"], settings.get("num_frames", 1))
    generators = [torch.Generator().manual_seed(s) for s in SEEDS]
    latents = family.initial_latents(pipe, generators, settings["resolution"], settings.get("num_frames", 1))
    return cond, latents, torch.tensor([0.9, 0.4])


@pytest.mark.parametrize("name", NAMES)
def test_exported_lora_loads_into_the_pipeline_as_the_actor_has_it(name, tiny_cache, tmp_path):
    from omni.checkpoint import save_lora
    from omni.weights import lora_tensors

    family, settings = get_family(name), tiny_settings(name)
    path = tiny_dir(name, tiny_cache)
    unused = family.unused_modules(family.tiny_transformer_config())
    actor, config = random_lora(family, path, exclude=unused)
    lora = {k: v.detach() for k, v in lora_tensors(actor, "default").items()}
    save_lora(tmp_path, lora, config, family)
    assert family.load_lora(tmp_path).keys() == lora.keys()
    # every block container and every target module carries the LoRA
    assert all(any(k.startswith(prefix) for k in lora) for prefix in family.layer_prefixes)
    assert all(any(f".{target}.lora_" in k for k in lora) for target in family.lora_targets)

    pipe = family.load_pipeline(path, torch.float32)
    cond, latents, sigmas = velocity_inputs(family, pipe, settings, GUIDED)
    warnings = WarningMessages()
    logging.getLogger("diffusers").addHandler(warnings)
    try:
        with torch.no_grad():
            base = family.predict_velocity(pipe.transformer, latents, sigmas, cond, GUIDED)
            in_pipeline = family.load_exported_lora(pipe, tmp_path, "exported")
            loaded = family.predict_velocity(pipe.transformer, latents, sigmas, cond, GUIDED)
            expected = family.predict_velocity(actor, latents, sigmas, cond, GUIDED)
    finally:
        logging.getLogger("diffusers").removeHandler(warnings)
    assert set(in_pipeline) == set(lora), "missing or unexpected LoRA keys"
    assert all(torch.equal(in_pipeline[k], lora[k]) for k in lora)
    assert not [m for m in warnings.messages if "led to unexpected keys" in m or "led to missing keys" in m]
    assert (base - loaded).abs().max() > 1e-4
    assert torch.allclose(loaded, expected, atol=1e-5)


@pytest.mark.parametrize("name", NAMES)
def test_unused_modules_are_the_lora_modules_without_a_gradient(name, tiny_cache):
    """With a LoRA on the family's targets, the targeted modules it reports unused (which
    validation excludes) are exactly those whose LoRA gets no gradient; every reported module
    exists."""
    family, settings = get_family(name), tiny_settings(name)
    pipe = pipeline(name, tiny_cache)
    actor, _ = random_lora(family, tiny_dir(name, tiny_cache))
    cond, latents, sigmas = velocity_inputs(family, pipe, settings, GUIDED)
    family.predict_velocity(actor, latents, sigmas, cond, GUIDED).square().sum().backward()
    lora_a = {
        n.split(".lora_A")[0].removeprefix("base_model.model."): p for n, p in actor.named_parameters() if "lora_A" in n
    }
    assert lora_a
    without_gradient = {m for m, p in lora_a.items() if p.grad is None or p.grad.abs().max() == 0}
    unused = family.unused_modules(family.tiny_transformer_config())
    assert set(unused) <= set(family.module_names())
    assert without_gradient == set(unused) & set(lora_a)
