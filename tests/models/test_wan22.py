"""What the Wan2.2 two-expert family adds beyond the family contract (tests/models/test_family_contract.py):
our ODE clips equal to a plain two-expert `WanPipeline`'s (the same guidance for both experts, and
`guidance_scale_2`), each sample routed to its expert by its own timestep, `model.train_experts`
putting the LoRA on the experts it names, the sync per expert, the export that
`WanPipeline.load_lora_weights` takes for both transformers, and the checkpoint paths."""

import json
import logging
import shutil

import pytest
import torch

from omni.config.model import LoraConfig
from omni.fsdp_utils import collect_lora_params
from omni.models import get_family
from omni.models.wan import FAMILY as WAN
from omni.models.wan22 import FAMILY, LOW_NOISE_LORA_FILE, WanExperts, load_both_experts
from omni.rollout.base import SamplingOptions
from omni.rollout.sampling import sample_rollout
from omni.weights import add_lora_adapter, lora_tensors
from tests.models.log_warnings import WarningMessages

PROMPTS = ["a red cat", "a blue dog with a tree"]
FRAMES, SIZE = 5, 32
SIGMAS = torch.tensor([0.9, 0.4])  # timesteps 900 (high-noise expert) and 400 (low-noise)


@pytest.fixture(scope="module")
def tiny_dir(tiny_cache):
    return FAMILY.tiny_path(tiny_cache, 0)


@pytest.fixture(scope="module")
def pipe(tiny_dir):
    pipe = FAMILY.load_pipeline(tiny_dir, torch.float32)
    pipe.set_progress_bar_config(disable=True)
    return pipe


def plain_pipeline(tiny_dir):
    """The checkpoint as diffusers publishes it: two transformers and the boundary."""
    from diffusers import WanPipeline

    plain = WanPipeline.from_pretrained(str(tiny_dir), local_files_only=True)
    plain.set_progress_bar_config(disable=True)
    return plain


class Settings:
    def __init__(self, train_experts=("high_noise", "low_noise"), guidance_scale_2=None):
        self.train_experts, self.guidance_scale_2 = list(train_experts), guidance_scale_2


def ode_clips(pipe, guidance_scale, guidance_scale_2=None):
    FAMILY.apply_settings(pipe.transformer, Settings(guidance_scale_2=guidance_scale_2))
    options = SamplingOptions(3, SIZE, guidance_scale, 0.7, max_sequence_length=16, sde_steps=(0, 0), num_frames=FRAMES)
    return sample_rollout(FAMILY, pipe, PROMPTS, [3, 4], options, 4, torch.device("cpu"), torch.float32).images


def test_family_routes_and_boundary(pipe, tiny_dir):
    assert get_family("wan22") is FAMILY and FAMILY.video and FAMILY.experts == ("high_noise", "low_noise")
    experts = pipe.transformer
    assert isinstance(experts, WanExperts) and experts.config.boundary_timestep == 875.0
    assert pipe.transformer_2 is experts.low_noise  # one copy, the pipeline's own __call__ uses it
    # the tiny schedule runs both experts: timesteps 1000 (high), 750 and 3 (low)
    timesteps = FAMILY.sigmas(pipe, 3, SIZE)[:-1] * 1000
    assert experts.routes_high(timesteps).tolist() == [True, False, False]


@pytest.mark.parametrize("guidance_scale_2", [None, 2.0], ids=["same-guidance", "guidance_scale_2"])
def test_ode_sampling_equals_the_two_expert_wan_pipeline(pipe, tiny_dir, guidance_scale_2):
    """The plain pipeline (its transformer above boundary_ratio x 1000, transformer_2 below,
    guidance_scale_2 for the latter) gives our clips; the other guidance gives other clips."""
    ours = ode_clips(pipe, 4.0, guidance_scale_2)
    extra = {} if guidance_scale_2 is None else {"guidance_scale_2": guidance_scale_2}
    theirs = plain_pipeline(tiny_dir)(
        PROMPTS, height=SIZE, width=SIZE, num_frames=FRAMES, num_inference_steps=3, max_sequence_length=16,
        generator=[torch.Generator().manual_seed(s) for s in (3, 4)], output_type="pt",
        **FAMILY.pipeline_guidance(4.0), **extra,
    ).frames  # fmt: skip
    assert ours.shape == theirs.shape == (2, FRAMES, 3, SIZE, SIZE) and theirs.std() > 0.05
    assert (ours - theirs).abs().max() < 1e-5
    other = ode_clips(pipe, 4.0, 1.5 if guidance_scale_2 else 2.0)
    assert (other - theirs).abs().max() > 1e-4


def test_each_sample_runs_its_own_expert(pipe):
    """A batch of mixed timesteps: each row is its expert's output alone (the boundary itself
    is the high-noise expert's, as in the pipeline); the experts differ."""
    experts = pipe.transformer
    cond = FAMILY.encode_prompts(pipe, PROMPTS * 2, 1.0, 16, "cpu")
    latents = torch.randn(4, 16, 2, 4, 4, generator=torch.Generator().manual_seed(0))
    timesteps = torch.tensor([900.0, 875.0, 874.0, 100.0])
    with torch.no_grad():
        mixed = experts(latents, timesteps, cond.embeds)[0]
        high = experts.high_noise(latents, timesteps, cond.embeds, return_dict=False)[0]
        low = experts.low_noise(latents, timesteps, cond.embeds, return_dict=False)[0]
    assert torch.allclose(mixed[:2], high[:2], atol=1e-6) and torch.allclose(mixed[2:], low[2:], atol=1e-6)
    assert (high - low).abs().max() > 1e-3


def actor_with_lora(path, train_experts=("high_noise", "low_noise"), snapshot=None):
    """The experts with a random LoRA on those that train (and a frozen snapshot adapter)."""
    from omni.weights import add_snapshot_adapter

    config = LoraConfig(rank=4, target_modules=list(FAMILY.lora_targets))
    actor = FAMILY.load_transformer(path, torch.float32)
    FAMILY.apply_settings(actor, Settings(train_experts))
    actor.requires_grad_(False)
    add_lora_adapter(actor, config)
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, p in actor.named_parameters():
            if "lora_" in name:
                p.copy_(torch.randn(p.shape, generator=generator) * 0.1)
    if snapshot:
        add_snapshot_adapter(actor, config, snapshot)
    return actor, config


def test_train_experts_puts_the_lora_on_those_named(tiny_dir):
    """Only the low-noise expert trains: its LoRA is all the trainable parameters, the
    high-noise expert carries none and runs as loaded."""
    actor, _ = actor_with_lora(tiny_dir, ["low_noise"])
    trainable = [n for n, p in actor.named_parameters() if p.requires_grad]
    assert trainable and all(n.startswith("low_noise.") and "lora_" in n for n in trainable)
    assert not any("lora_" in n for n, _ in actor.high_noise.named_parameters())


@pytest.mark.parametrize("layered", [False, True], ids=["whole", "layered"])
def test_collect_and_engine_sync_per_expert(tiny_dir, pipe, layered):
    """collect_lora_params keeps the experts' LoRA tensors apart (`high_noise.` / `low_noise.`,
    the snapshot adapter left out); an engine synced with them gives the actor's velocity at
    a high-noise and a low-noise level."""
    from omni.rollout.diffusers_engine import load_diffusers_engine

    actor, config = actor_with_lora(tiny_dir, snapshot="ema")
    prefixes = FAMILY.layer_prefixes
    lora = collect_lora_params(actor, layered, True, True, "default", prefixes)
    assert lora.keys() == lora_tensors(actor, "default").keys()
    per_expert = {e: {k.split(".", 1)[1] for k in lora if k.startswith(e + ".")} for e in FAMILY.experts}
    assert per_expert["high_noise"] and per_expert["high_noise"] == per_expert["low_noise"]
    assert not torch.equal(lora[next(iter(sorted(lora)))], lora[sorted(lora)[len(lora) // 2]])

    engine = load_diffusers_engine(FAMILY, tiny_dir, torch.device("cpu"), torch.float32, 4, load_base=False)
    engine.update_weights(collect_lora_params(actor, False, False, True, "default", prefixes), False, config)
    engine.update_weights(lora, True, config)
    cond = FAMILY.encode_prompts(pipe, PROMPTS, 4.0, 16, "cpu")
    latents = torch.randn(2, 16, 2, 4, 4, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ours = FAMILY.predict_velocity(engine.transformer, latents, SIGMAS, cond, 4.0)
        expected = FAMILY.predict_velocity(actor, latents, SIGMAS, cond, 4.0)
    assert torch.allclose(ours, expected, atol=1e-5)


@pytest.mark.parametrize("train_experts", [["high_noise", "low_noise"], ["low_noise"]], ids=["both", "low-only"])
def test_export_loads_into_a_plain_wan_pipeline(tiny_dir, pipe, tmp_path, train_experts):
    """Our export, loaded by `WanPipeline.load_lora_weights` (the second file with
    `load_into_transformer_2=True`) with no missing or unexpected keys, gives each of its
    transformers our expert's LoRA and the pipeline our velocities."""
    from peft.utils import get_peft_model_state_dict

    from omni.checkpoint import check_lora_file, save_lora

    actor, config = actor_with_lora(tiny_dir, train_experts)
    lora = {k: v.detach() for k, v in lora_tensors(actor, "default").items()}
    save_lora(tmp_path, lora, config, FAMILY)
    assert (tmp_path / "pytorch_lora_weights.safetensors").is_file() == ("high_noise" in train_experts)
    assert (tmp_path / LOW_NOISE_LORA_FILE).is_file()
    assert FAMILY.load_lora(tmp_path).keys() == lora.keys()
    check_lora_file(tmp_path / LOW_NOISE_LORA_FILE, config)

    plain = plain_pipeline(tiny_dir)
    warnings = WarningMessages()
    logging.getLogger("diffusers").addHandler(warnings)
    try:
        load_both_experts(plain, tmp_path, "exported")
    finally:
        logging.getLogger("diffusers").removeHandler(warnings)
    assert not [m for m in warnings.messages if "unexpected keys" in m or "missing keys" in m]
    for expert, module in (("high_noise", plain.transformer), ("low_noise", plain.transformer_2)):
        ours = {k[len(expert) + 1 :]: v for k, v in lora.items() if k.startswith(expert + ".")}
        loaded = get_peft_model_state_dict(module, adapter_name="exported") if ours else {}
        assert loaded.keys() == ours.keys() and all(torch.equal(loaded[k], ours[k]) for k in ours)
    cond = FAMILY.encode_prompts(pipe, PROMPTS, 4.0, 16, "cpu")
    latents = torch.randn(2, 16, 2, 4, 4, generator=torch.Generator().manual_seed(1))
    view = WanExperts.of(plain.transformer, plain.transformer_2, 875.0)
    with torch.no_grad():
        theirs = FAMILY.predict_velocity(view, latents, SIGMAS, cond, 4.0)
        expected = FAMILY.predict_velocity(actor, latents, SIGMAS, cond, 4.0)
        base = FAMILY.predict_velocity(pipe.transformer, latents, SIGMAS, cond, 4.0)
    assert torch.allclose(theirs, expected, atol=1e-5)
    changed = (base - expected).flatten(1).abs().amax(1) > 1e-4
    assert changed.tolist() == ["high_noise" in train_experts, True]


def test_checkpoint_holds_both_experts(tiny_dir, tmp_path):
    """save_checkpoint / load_checkpoint round-trip both experts' adapters; a checkpoint of
    the low-noise expert alone is intact and another configuration for a run of both."""
    from omni.checkpoint import CheckpointMismatch, check_checkpoint, load_checkpoint, save_checkpoint
    from omni.config.model import ModelConfig

    actor, config = actor_with_lora(tiny_dir)
    lora = {k: v.detach().clone() for k, v in lora_tensors(actor, "default").items()}
    saved = save_checkpoint(tmp_path, 1, lora, config, {"config": None}, FAMILY)
    loaded, state = load_checkpoint(saved, FAMILY)
    assert state["step"] == 1 and loaded.keys() == lora.keys()
    assert all(torch.equal(loaded[k], lora[k]) for k in lora)

    low = {k: v for k, v in lora.items() if k.startswith("low_noise.")}
    model = ModelConfig(family="wan22", tiny_seed=0, lora=config, train_experts=["low_noise"])
    lora_yaml = f"{{rank: 4, alpha: 16.0, target_modules: {list(FAMILY.lora_targets)}}}"
    yaml = f"model: {{family: wan22, train_experts: [low_noise], lora: {lora_yaml}}}"
    only_low = save_checkpoint(tmp_path, 2, low, config, {"config": yaml}, FAMILY)
    check_checkpoint(only_low, model)
    model.train_experts = ["high_noise", "low_noise"]
    with pytest.raises(CheckpointMismatch, match="model.train_experts"):
        check_checkpoint(only_low, model)


def test_paths_go_to_their_family(tmp_path, tiny_dir, tiny_wan_dir):
    """A two-expert checkpoint is wan22's: model=wan names model=wan22; wan22 refuses one transformer."""
    moe = tmp_path / "a14b"
    shutil.copytree(tiny_dir, moe, ignore=shutil.ignore_patterns("*.safetensors"))
    with pytest.raises(ValueError, match="model.path=.*boundary_ratio=0.875.*model=wan22"):
        WAN.check_path(str(moe))
    assert FAMILY.check_path(str(moe)) == moe
    with pytest.raises(ValueError, match="model.path=.*not a Wan2.2 two-expert checkpoint.*model=wan"):
        FAMILY.check_path(str(tiny_wan_dir))
    index = json.loads((moe / "model_index.json").read_text())
    assert index["boundary_ratio"] == 0.875 and index["transformer_2"][1] == "WanTransformer3DModel"


def test_published_a14b_holds_two_14b_experts():
    """The shipped A14B expert config is 14.3B parameters (Wan2.1 T2V 14B's architecture);
    the memory count holds both experts and one expert's blocks per pass."""
    from omni.memory import arch_config, count

    config = arch_config(FAMILY, "wan2.2-t2v-a14b")
    one = sum(p.numel() for p in WAN.meta_transformer(config=config).parameters())
    assert round(one / 1e9, 1) == 14.3
    sizes = count(FAMILY, config, LoraConfig(rank=32, target_modules=list(FAMILY.lora_targets)))
    assert sizes["params"] == 2 * one and sizes["blocks"] == 40 and sizes["experts"] == 2
