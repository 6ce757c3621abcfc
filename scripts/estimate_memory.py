"""Will it fit? Per-GPU memory of a training run, estimated before launch (what is counted:
the docstring of `omni.bench.estimate_memory` and omni/memory.py).

    python scripts/estimate_memory.py                      # SD3.5-Medium/Large, 512/1024 px, +-checkpointing
    python scripts/estimate_memory.py --arch sd3.5-large --resolution 1024 --micro-batch 2 \
        --gradient-checkpointing experiment=sd3_flow_grpo model.path=/ckpt/sd3.5-large
    python scripts/estimate_memory.py model=flux trainer.n_workers=8   # FLUX.1-dev/-schnell on 8 GPUs
    python scripts/estimate_memory.py model=wan22 --resolution 480   # Wan2.2 A14B: both experts resident
"""

from omni.bench.estimate_memory import main

if __name__ == "__main__":
    main()
