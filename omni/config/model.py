"""Schema of the `model` group: which transformer, its LoRA (or full fine-tuning) and its FSDP sharding."""

from dataclasses import dataclass, field
from enum import Enum
from typing import List, Optional

from omegaconf import MISSING

from omni.config.errors import require


class DType(str, Enum):
    auto = "auto"  # bfloat16 on GPU, float32 on CPU
    float32 = "float32"
    bfloat16 = "bfloat16"
    float16 = "float16"


EXPERTS = ("high_noise", "low_noise")


@dataclass
class LoraConfig:
    rank: int = 8
    alpha: float = 16.0
    # None: the model family's default targets (omni/models/<family>.py, `lora_targets`).
    target_modules: Optional[List[str]] = None
    # Modules left out although a target matches them (a name, or a suffix of one).
    exclude_modules: List[str] = field(default_factory=list)
    adapter_name: str = "default"
    # Start from an existing LoRA instead of B = 0: a diffusers LoRA file or a directory
    # holding one (`pytorch_lora_weights.safetensors`, as our checkpoints and diffusers'
    # `save_lora_weights` write it) or PEFT's (`adapter_model.safetensors`). Its rank and
    # targets must be this config's; checked before any model loads. A resumed run continues
    # from its checkpoint instead.
    init_from: Optional[str] = None

    def __post_init__(self) -> None:
        """The rules on the LoRA's own fields (see RolloutConfig.__post_init__)."""
        require(self.rank > 0, f"model.lora.rank={self.rank} must be positive")
        require(bool(self.adapter_name), "model.lora.adapter_name must not be empty")
        require(self.target_modules is None or len(self.target_modules) > 0, "model.lora.target_modules is empty")


@dataclass
class FSDPConfig:
    # 2: FSDP2 (fully_shard per block + root), 1: FSDP1, 0: no sharding: with several workers
    # each holds the whole base and only the LoRA's gradients are averaged (all-reduced),
    # the faster choice for a base that fits on each device. A single worker shards nothing.
    # None: 0 for a LoRA whose replicated run fits each device (omni/memory.py's estimate
    # against trainer.device_memory_gib or the CUDA device; always on a CPU), else 2.
    version: Optional[int] = None
    # Block containers sharded and summoned one at a time; every model declares its own.
    layer_prefixes: List[str] = MISSING

    def __post_init__(self) -> None:
        require(
            self.version in (None, 0, 1, 2),
            f"model.fsdp.version={self.version}: expected 0, 1, 2 or null (replicated where the base fits, else 2)",
        )


@dataclass
class ModelConfig:
    # A module of omni/models/ (sd3, ...).
    family: str = MISSING
    # A local diffusers checkpoint directory; must stay unset when `tiny_seed` is set.
    path: Optional[str] = None
    # Build a tiny random model offline from this seed instead of reading `path`.
    tiny_seed: Optional[int] = None
    # Where tiny models are built and cached ($OMNI_CACHE_DIR when set).
    cache_dir: str = "${oc.env:OMNI_CACHE_DIR,'~/.cache/omni-recipes'}"
    # With full fine-tuning (lora: null) the trained weights are the model's own: float32
    # (auto resolves to it; a lower compute dtype is refused at validation).
    dtype: DType = DType.auto
    # Sampling defaults native to the model; the rollout group may override them.
    resolution: int = 512
    guidance_scale: float = 4.5
    max_sequence_length: int = 256
    # Frames per clip and frame rate of a video model; an image model makes 1 frame.
    num_frames: int = 1
    fps: int = 16
    # Encode images (DPO's pairs) by this many Adam steps inverting the VAE's decoder instead
    # of with its encoder: for a VAE whose encoder does not invert its decoder, as a tiny
    # random one's does not. 0: the encoder (what a trained VAE is for).
    vae_inversion_steps: int = 0
    # Recompute each transformer block's activations in the backward pass instead of keeping
    # them (python scripts/estimate_memory.py shows what it saves; trainer.device_memory_gib checks it).
    gradient_checkpointing: bool = False
    # The adapter that trains; null (`model.lora=null`): full fine-tuning, every parameter of
    # the transformer trains, and the reference, when the algorithm has one, is a frozen copy
    # of the initial transformer.
    lora: Optional[LoraConfig] = field(default_factory=LoraConfig)
    # A model of two experts switched by noise level (Wan2.2 A14B, model=wan22): the experts
    # the LoRA trains (high_noise, low_noise; the others run frozen), and the low-noise
    # expert's guidance scale (null: the rollout's guidance_scale). Other models take neither.
    train_experts: List[str] = field(default_factory=lambda: list(EXPERTS))
    guidance_scale_2: Optional[float] = None
    fsdp: FSDPConfig = field(default_factory=FSDPConfig)

    def __post_init__(self) -> None:
        """The rules on the model's own fields (see RolloutConfig.__post_init__); whether its
        weights can be read, and its LoRA's targets, are omni.validation's."""
        require(
            self.vae_inversion_steps >= 0,
            f"model.vae_inversion_steps={self.vae_inversion_steps} must be >= 0 (0: the VAE's encoder)",
        )
        experts = list(self.train_experts)
        require(
            bool(experts) and set(experts) <= set(EXPERTS) and len(set(experts)) == len(experts),
            f"model.train_experts={experts}: expected a non-empty list of distinct names among {list(EXPERTS)}",
        )
