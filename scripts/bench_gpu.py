"""GPU benchmark of the real SD3.5-Medium and FLUX.1-dev architectures with random weights
(no download); prints JSON, one section per architecture. What it measures and how: the
docstring of `omni.bench.gpu`; the FLOPs model: `omni.flops`.

    python scripts/bench_gpu.py                      # SD3.5-Medium then FLUX.1-dev: 512 px, bf16, cuda
    python scripts/bench_gpu.py --arch flux.1-dev --resolution 1024 --batch 4
    python scripts/bench_gpu.py --estimate           # the FLOPs and seconds estimate only (meta device)
    python scripts/bench_gpu.py --tiny --device cpu --dtype float32   # checks the script on each family's tiny model
"""

from omni.bench.gpu import main

if __name__ == "__main__":
    main()
