"""Train a LoRA on a diffusion transformer with Flow-GRPO (or DPO), configured by Hydra.

    python recipes/train.py                       # tiny offline SD3, diffusers rollout, CPU
    python recipes/train.py model=sd3 model.path=/ckpt/sd3.5-medium rollout=vllm trainer=gpu
    python recipes/train.py -m seed=1,2 algorithm.clip_range=1e-4,2e-4

The same as the installed `omni-train` command (omni/cli.py): compose the config groups of
omni/conf/ -> validate (before any model loads) -> build -> train. Returns the final
evaluation reward, so Hydra sweepers can optimise it.
"""

from omni.cli import train

if __name__ == "__main__":
    train()
