"""Build the latent cache of a preference set before training: VAE latents of every chosen
and rejected image and the text embeddings of every prompt, in memory-mappable shards.

    python scripts/cache_latents.py algorithm=dpo data=pairs data.pairs=/data/pick-a-pic data.latent_cache=/data/latents
    python recipes/train.py algorithm=dpo data=pairs data.pairs=/data/pick-a-pic data.latent_cache=/data/latents

Arguments are the training run's Hydra overrides: the cache is made for its model (VAE and
text encoders), resolution, text length, dtype and data, and a run with other ones refuses
it. An interrupted build continues after its last whole shard. Without this command, the
first training run with data.latent_cache builds the cache itself.
"""

from __future__ import annotations

import sys
import time


def run_config(overrides):
    from omni.composing import compose_train
    from omni.validation import validate

    return validate(compose_train(["output_dir=/tmp/cache-latents", *overrides]))


def main(argv=None) -> None:
    from omni.algorithms.dpo_pairs import PairData, model_dir
    from omni.devices import torch_dtype
    from omni.distributed import pick_device
    from omni.models import get_family
    from omni.rollout.diffusers_engine import load_diffusers_engine

    cfg = run_config(sys.argv[1:] if argv is None else argv)
    data = PairData(cfg)  # scans the pairs, or checks a complete cache against this run
    if data.cache_dir is None:
        raise SystemExit(
            "set data.latent_cache=DIR: the directory to write the cache to (auto caches only pairs encoded by "
            "decoder inversion)"
        )
    if data.cache is not None:
        print(f"data.latent_cache={data.cache_dir} is complete: {len(data.cache)} pairs")
        return
    device = pick_device(cfg.trainer.device, 0)
    engine = load_diffusers_engine(
        get_family(cfg.model.family),
        model_dir(cfg.model),
        device,
        torch_dtype(cfg.model.dtype, device),
        cfg.rollout.micro_batch_size,
        load_base=True,
        vae_inversion_steps=cfg.model.vae_inversion_steps,
    )
    tick = time.perf_counter()
    data.ensure_cache(engine, cfg.rollout.resolution, cfg.model.max_sequence_length, progress=True)
    print(
        f"data.latent_cache={data.cache_dir}: {len(data.cache)} pairs in {time.perf_counter() - tick:.1f} s "
        f"({data.stats})"
    )


if __name__ == "__main__":
    main()
