"""The in-process rollout engine: a model family's diffusers pipeline sampled with SDE log-probs.

The sampling itself is `omni.rollout.sampling.sample_rollout`, shared with the vLLM-Omni
engine's pipeline (`rollout.options.backend=vllm`; the `native` backend's scheduler takes the
same step, `sampling.rollout_step`), so the engines give the same trajectories for the same
weights.

The engine either holds its own copy of the transformer, updated by weight syncs, or
samples with the actor's own transformer (`rollout.share_actor`): then one copy lives on
each device, a sync has nothing to send, and the rollout is the actor's policy by
construction. A transformer sharded with FSDP2 is gathered once per rollout, so the
sampling forwards run without collectives (and workers need not run them in lockstep).
"""

from __future__ import annotations

import contextlib
from typing import Dict, List, Optional, Sequence

import torch

from omni.config.algorithm import CFGGradient
from omni.config.model import LoraConfig
from omni.config.rollout import RolloutConfig
from omni.models.base import Conditioning, ModelFamily
from omni.rollout.base import RolloutBatch, SamplingOptions
from omni.rollout.sampling import PromptCache, sample_rollout
from omni.weights import add_lora_adapter, load_base_weights, load_lora_weights, lora_module_names, lora_tensors


class DiffusersEngine:
    def __init__(
        self,
        family: ModelFamily,
        pipe,
        device: torch.device,
        dtype: torch.dtype,
        micro_batch_size: int,
        has_base: bool = True,
        actor=None,
        offload_text_encoders: bool = False,
        vae_inversion_steps: int = 0,
        keep_uncond: bool = False,
    ):
        """`actor`: the trained transformer to sample with (shared, not copied); None: the
        pipeline's own transformer, which syncs update. `offload_text_encoders`: see
        `PromptCache`. `vae_inversion_steps`: images are encoded by inverting the decoder
        (`omni.models.base.invert_decoder`) instead of with the VAE's encoder. `keep_uncond`:
        rollouts keep the unconditional velocity of their SDE steps (`sample_rollout`)."""
        self.family = family
        self.prompts = PromptCache(family, pipe, device, offload_text_encoders)
        for name, component in pipe.components.items():
            if isinstance(component, torch.nn.Module) and name not in family.text_encoders:
                component.to(device)
        self.prompts.place_encoders()
        self.pipe = pipe
        self.pipe.set_progress_bar_config(disable=True)
        self.shares_actor = actor is not None
        if self.shares_actor:
            pipe.transformer = actor
        else:
            pipe.transformer.eval().requires_grad_(False)
        self.transformer = pipe.transformer
        self.dtype = dtype
        self.device = device
        self.micro_batch_size = micro_batch_size
        self.vae_inversion_steps = vae_inversion_steps
        self.keep_uncond = keep_uncond
        self.has_base = has_base or self.shares_actor
        self.adapter_name: Optional[str] = None
        self.lora_modules: Optional[List[str]] = None  # where its adapter is bound, after the last LoRA sync

    def generate(self, prompts: Sequence[str], seeds: Sequence[int], options: SamplingOptions) -> RolloutBatch:
        with self._sampling_mode():
            return sample_rollout(
                self.family,
                self.pipe,
                prompts,
                seeds,
                options,
                self.micro_batch_size,
                self.device,
                self.dtype,
                self.prompts,
                self.keep_uncond,
            )

    @contextlib.contextmanager
    def _sampling_mode(self):
        """The shared actor in eval mode and, under FSDP2, gathered for the whole rollout."""
        if not self.shares_actor:
            yield
            return
        training = self.transformer.training
        self.transformer.eval()
        try:
            with gathered(self.transformer):
                yield
        finally:
            self.transformer.train(training)

    def encode_prompts(self, prompts: Sequence[str], guidance_scale: float, max_sequence_length: int) -> Conditioning:
        return self.prompts.encode(prompts, guidance_scale, max_sequence_length).apply(lambda t: t.cpu())

    def encode_images(self, images: torch.Tensor) -> torch.Tensor:
        """Images in [0, 1] -> the transformer's latents."""
        return self.family.encode_images(self.pipe, images, self.device, self.vae_inversion_steps)

    def update_weights(
        self, named_tensors: Dict[str, torch.Tensor], base_sync_done: bool, lora: Optional[LoraConfig]
    ) -> None:
        """Base weights (base_sync_done False) or the LoRA of `lora.adapter_name`; after a LoRA
        sync, `lora_modules` lists the modules its PEFT model carries that adapter on."""
        if self.shares_actor:
            raise RuntimeError("the engine samples with the actor's transformer: there is nothing to sync")
        if not base_sync_done:
            load_base_weights(self.transformer, named_tensors)
            self.has_base = True
            return
        if not self.has_base:
            raise RuntimeError("the engine got LoRA weights before any base weights; sync the base first")
        if self.adapter_name is None:
            add_lora_adapter(self.transformer, lora)
            self.adapter_name = lora.adapter_name
        load_lora_weights(self.transformer, named_tensors, self.adapter_name)
        self.lora_modules = lora_module_names(lora_tensors(self.transformer, self.adapter_name))

    def shutdown(self) -> None:
        self.pipe = self.transformer = None


@contextlib.contextmanager
def gathered(module: torch.nn.Module):
    """Every FSDP2 unit of `module` unsharded, and kept so across forwards, until exit."""
    from torch.distributed.fsdp import FSDPModule

    units = [m for m in module.modules() if isinstance(m, FSDPModule)]
    for unit in units:
        unit.set_reshard_after_forward(False, recurse=False)
        unit.unshard()
    try:
        yield
    finally:
        for unit in units:
            unit.reshard()
            unit.set_reshard_after_forward(True, recurse=False)


def load_diffusers_engine(
    family: ModelFamily,
    model_path,
    device: torch.device,
    dtype: torch.dtype,
    micro_batch_size: int,
    load_base: bool,
    actor=None,
    offload_text_encoders: bool = False,
    vae_inversion_steps: int = 0,
    keep_uncond: bool = False,
    model=None,
) -> DiffusersEngine:
    """An engine on the checkpoint at `model_path`, sampling with `actor` when given (its
    own transformer is then never loaded); without `load_base`, its transformer is a dummy
    of the right shape that the first weight sync fills. `model`: the run's model settings
    its own transformer takes (`ModelFamily.apply_settings`)."""
    pipe = family.load_pipeline(model_path, dtype, load_base, without_transformer=actor is not None)
    if actor is None and model is not None:
        family.apply_settings(pipe.transformer, model)
    return DiffusersEngine(
        family,
        pipe,
        device,
        dtype,
        micro_batch_size,
        load_base,
        actor,
        offload_text_encoders,
        vae_inversion_steps,
        keep_uncond,
    )


Options = RolloutConfig  # rollout=diffusers takes the options every engine takes


def can_share_actor(cfg) -> bool:
    """In process, it can sample with the actor's transformer: with one worker, or with FSDP2
    or a replicated base (whose shards are gathered for sampling)."""
    return cfg.trainer.n_workers == 1 or cfg.model.fsdp.version in (None, 0, 2)


def build(
    cfg, family: ModelFamily, model_path: str, device: torch.device, dtype: torch.dtype, actor=None
) -> DiffusersEngine:
    """`rollout.engine=diffusers`. With `algorithm.cfg_gradient=conditional` the update
    takes the rollout's unconditional velocities for its first optimizer step."""
    rollout = cfg.rollout
    conditional = getattr(cfg.algorithm, "cfg_gradient", None) == CFGGradient.conditional
    return load_diffusers_engine(
        family,
        model_path,
        device,
        dtype,
        rollout.micro_batch_size,
        rollout.load_base,
        actor,
        rollout.offload_text_encoders,
        cfg.model.vae_inversion_steps,
        keep_uncond=conditional,
        model=cfg.model,
    )
