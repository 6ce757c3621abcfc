"""Pretrain a micro FLUX.1 Kontext on the toy recolour edits (omni.recolor): the checkpoint
that ships as omni/assets/micro_kontext (`model=micro_kontext`), the recolour task's
starting point (`experiment=recolor`).

    python scripts/pretrain_micro_kontext.py /tmp/micro_kontext --threads 1 --save-every 500
    python scripts/eval_micro_kontext.py /tmp/micro_kontext   # held-out edit_target / edit_consistency

The pipeline is a FluxKontextPipeline assembled from:
- the shipped micro SD3's trained VAE (omni/assets/micro/vae: 4 latent channels, factor 4),
  as it is: FLUX packs its 4-channel latents into 2x2 tokens of 16 features, so a 64 px image
  is 8 x 8 = 64 tokens and its source as many reference tokens;
- tokenizers whose vocabulary holds every recolour word (one token each) and frozen random
  CLIP (no projection: FLUX takes its pooled output) and T5 encoders (the transformer learns
  to read them); FLUX.1-dev's scheduler config;
- a small FluxTransformer2DModel with a guidance embedding (Kontext [dev] is guidance-distilled),
  trained at the one guidance the configs sample with (2.5), by rectified flow matching on VAE
  latents of a fixed pool of recolour edits (seeds disjoint from the shipped sets'), encoded
  once: for a target latent z, noise e and t ~ sigmoid(N(0, 1)), it predicts e - z at
  (1 - t) z + t e. The inputs are exactly a rollout's: the text through FLUX's
  `encode_prompts`, the source (rounded to 8 bits, as the shipped PNGs are) through
  `FluxKontextFamily.encode_source`, and the velocity through the family's `predict_velocity`
  (which gives the transformer sigma itself as the timestep; FLUX multiplies it by 1000).
  The learning rate warms up, then decays on a cosine; the checkpoint holds the weights' EMA.
Every batch is a function of (seed, step); with --threads 1 the run is deterministic on a CPU
(tests/models/test_micro_kontext.py pins its first steps).

Measured for the shipped weights (the defaults, one thread, the other core mostly idle): the
pool of 4,096 edits takes 53 s; the transformer (2 double and 4 single blocks, 8 heads of 16:
2.3M parameters, 9.4 MB) 0.43 s a step, 2,500 steps in 18 minutes, loss 2.58 -> 0.17. Held-out
(scripts/eval_micro_kontext.py --images 4: the 32 held-out edits, 4 seeds each, 20 Euler steps
of the ODE, guidance 2.5):

    checkpoint                       edit_target  edit_consistency
    the shipped weights (step 2500)  0.736        0.983
    EMA at step 2000                 0.713        0.982
    the tiny random FLUX.1 Kontext   0.602        0.723
    for scale: the source itself     0.597        1.000
               a uniform grey image  0.692        0.978

(EMA at steps 500 / 1000 / 1500, one image an edit: edit_target 0.628 / 0.645 / 0.644.) It
copies the layout and the shape left alone, and redraws the shape to recolour in place, in the
named colour only some of the time (others: its old colour, a wrong one, or the other shape
recoloured): room for the edit rewards to teach.
"""

from __future__ import annotations

import argparse
import json
import time

import numpy as np
import torch
import torch.nn.functional as F
from PIL import Image

from omni.models.assets import asset_path
from omni.models.flux import DEV_SCHEDULER, FluxFamily
from omni.models.flux_kontext import FAMILY, FluxKontextConditioning
from omni.models.tiny_parts import clip_encoder, clip_tokenizer, save_pipeline, t5_encoder, t5_tokenizer
from omni.pretraining import progress_and_snapshots, train_with_ema
from omni.recolor import COLORS, SHAPES, SIZE, recolor_edit

WORDS = ("make", "the", *SHAPES, *COLORS)
TEXT_LENGTH = 16  # both tokenizers: an instruction is 5 tokens plus the special ones
GUIDANCE = 2.5  # FluxKontextPipeline's default, and model=micro_kontext's
TRANSFORMER = dict(
    patch_size=1,
    in_channels=16,  # the micro VAE's 4 channels x a 2x2 patch
    num_layers=2,
    num_single_layers=4,
    attention_head_dim=16,
    num_attention_heads=8,
    joint_attention_dim=64,  # the T5's width
    pooled_projection_dim=32,  # the CLIP's width
    guidance_embeds=True,
    axes_dims_rope=(4, 6, 6),  # sums to attention_head_dim
)
# The pool's edits: a generator and scene seeds of their own, far from the shipped sets'
# (omni.recolor.SHIPPED: generators 0 and 1, scene seeds below 200,000).
POOL_RNG, POOL_SCENES = 7_000, 50_000_000


def micro_kontext_pipeline(seed: int, layers: int = 2, single_layers: int = 4):
    """The untrained pipeline (the micro SD3's trained VAE), identical for identical seeds."""
    from diffusers import AutoencoderKL, FlowMatchEulerDiscreteScheduler, FluxKontextPipeline, FluxTransformer2DModel

    clip_tok, t5_tok = clip_tokenizer(TEXT_LENGTH, WORDS), t5_tokenizer(TEXT_LENGTH, WORDS)
    clip, t5 = (
        clip_encoder(clip_tok, seed + 1, with_projection=False),
        t5_encoder(t5_tok, seed + 2, TRANSFORMER["joint_attention_dim"]),
    )
    torch.manual_seed(seed)
    transformer = FluxTransformer2DModel(**{**TRANSFORMER, "num_layers": layers, "num_single_layers": single_layers})
    return FluxKontextPipeline(
        transformer=transformer,
        scheduler=FlowMatchEulerDiscreteScheduler(**DEV_SCHEDULER),
        vae=AutoencoderKL.from_pretrained(asset_path("micro"), subfolder="vae"),
        # in eval mode, as from_pretrained loads them: T5's dropout would otherwise perturb the
        # embeddings the transformer trains on
        text_encoder=clip.eval(),
        tokenizer=clip_tok,
        text_encoder_2=t5.eval(),
        tokenizer_2=t5_tok,
    )


def pool_edits(n: int, seed: int):
    """`n` recolour edits (instruction, source, target), images rounded to 8 bits as PNGs hold them."""
    rng = np.random.default_rng(POOL_RNG + seed)
    edits = []
    for i in range(n):
        text, source, target = recolor_edit(rng, SIZE, seed=POOL_SCENES * (seed + 1) + i)
        edits.append((text, *((image.clamp(0, 1) * 255).round() / 255 for image in (source, target))))
    return edits


def to_pil(image: torch.Tensor) -> Image.Image:
    return Image.fromarray((image * 255).round().to(torch.uint8).permute(1, 2, 0).numpy())


@torch.no_grad()
def latent_pool(pipe, edits):
    """The training set, computed once: each edit's packed target latents, its source's
    latents as the family conditions on them, and an index into the distinct instructions'
    text embeddings (T5 sequence, CLIP pooled)."""
    device = torch.device("cpu")
    texts = sorted({text for text, _, _ in edits})
    index = {text: i for i, text in enumerate(texts)}
    text = FluxFamily.encode_prompts(FAMILY, pipe, texts, GUIDANCE, TEXT_LENGTH, device)
    sources = torch.cat([FAMILY.encode_source(pipe, to_pil(source), device) for _, source, _ in edits])
    targets = torch.cat(
        [
            FAMILY.encode_images(pipe, torch.stack([t for _, _, t in edits[s : s + 64]]), device)
            for s in range(0, len(edits), 64)
        ]
    )
    return targets, sources, torch.tensor([index[t] for t, _, _ in edits]), text.embeds, text.pooled


def flow_matching_loss(transformer, pool, step: int, args):
    """Step `step`'s loss on a batch of the pool: rectified flow at t ~ sigmoid(N(0, 1)),
    the velocity from the family's `predict_velocity` at sigma t with the source's tokens."""
    targets, sources, text, embeds, pooled = pool
    g = torch.Generator().manual_seed(args.seed * 7919 + step)
    picked = torch.randint(len(targets), (args.batch,), generator=g)
    z = targets[picked]
    noise = torch.randn(z.shape, generator=g)
    t = torch.sigmoid(torch.randn(args.batch, generator=g))
    cond = FluxKontextConditioning(embeds[text[picked]], pooled[text[picked]], sources[picked])
    pred = FAMILY.predict_velocity(
        transformer, (1 - t[:, None, None]) * z + t[:, None, None] * noise, t, cond, GUIDANCE
    )
    return F.mse_loss(pred, noise - z)


def train_transformer(pipe, pool, args, on_step=None) -> list:
    """`omni.pretraining.train_with_ema` on the pool's flow-matching loss; the pipeline ends
    with the weights' moving average."""
    return train_with_ema(
        pipe.transformer, lambda transformer, step: flow_matching_loss(transformer, pool, step, args), args, on_step
    )


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out_dir")
    parser.add_argument("--steps", type=int, default=2500)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--pool", type=int, default=4096, help="edits whose latents the transformer trains on")
    parser.add_argument("--layers", type=int, default=TRANSFORMER["num_layers"], help="double-stream blocks")
    parser.add_argument("--single-layers", type=int, default=TRANSFORMER["num_single_layers"])
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--warmup", type=int, default=100)
    parser.add_argument("--ema", type=float, default=0.995)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument(
        "--save-every", type=int, default=0, help="also write out_dir-stepN every N steps (EMA weights)"
    )
    return parser.parse_args(argv)


def prepare(args):
    """The untrained pipeline and the encoded pool."""
    torch.set_num_threads(args.threads)
    torch.use_deterministic_algorithms(True)
    pipe = micro_kontext_pipeline(args.seed, args.layers, args.single_layers)
    for part in (pipe.vae, pipe.text_encoder, pipe.text_encoder_2):
        part.requires_grad_(False)
    report = {"transformer_parameters": sum(p.numel() for p in pipe.transformer.parameters())}
    start = time.perf_counter()
    pool = latent_pool(pipe, pool_edits(args.pool, args.seed))
    report["pool_s"] = time.perf_counter() - start
    return pipe, pool, report


def main() -> None:
    args = parse_args()
    pipe, pool, report = prepare(args)
    print(json.dumps(report), flush=True)
    start = time.perf_counter()

    on_step = progress_and_snapshots(pipe, args, 50, start)
    losses = train_transformer(pipe, pool, args, on_step)
    report["transformer_s_per_step"] = (time.perf_counter() - start) / max(args.steps, 1)
    report["loss_first_last"] = [losses[:1], losses[-5:]]
    save_pipeline(pipe, args.out_dir)
    print(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
