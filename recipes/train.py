"""Train a LoRA on a diffusion transformer with Flow-GRPO (or DPO), configured by Hydra.

    python recipes/train.py                       # tiny offline SD3, diffusers rollout, CPU
    python recipes/train.py model=sd3 model.path=/ckpt/sd3.5-medium rollout=vllm trainer=gpu
    python recipes/train.py -m seed=1,2 algorithm.clip_range=1e-4,2e-4

Compose -> validate (before any model loads) -> build -> train. Returns the final
evaluation reward, so Hydra sweepers can optimise it.
"""

import logging

import hydra
from omegaconf import DictConfig

from omni.config import register_configs
from omni.config.presets import describe_model_algorithm_preset

register_configs()
log = logging.getLogger("omni.recipes.train")


@hydra.main(config_path="../conf", config_name="train", version_base="1.3")
def main(cfg: DictConfig) -> float:
    from omni.trainer import run

    log.info(describe_model_algorithm_preset(cfg))
    return run(cfg)


if __name__ == "__main__":
    main()
