"""Pretrain a micro Stable Diffusion 3 on rendered scenes (omni.scenes): the checkpoint that
ships as omni/assets/micro (`model=micro`), the scene task's starting point.

    python scripts/pretrain_micro.py /tmp/micro --threads 1      # the shipped weights, ~55 min
    python scripts/eval_micro.py /tmp/micro          # held-out accuracy per category

The pipeline is the tiny SD3's layout with parts sized for scenes:
- tokenizers whose vocabulary holds every scene word (omni.scenes.WORDS; T5 gives each word
  one token, CLIP splits some), frozen random CLIP and T5 encoders (the transformer learns
  to read them);
- a VAE of three levels (a 64 px scene is a 16 x 16 x 4 latent; the tiny SD3's four levels
  leave a 12 px shape about one latent pixel), trained first on renders: reconstruction
  error plus a small KL term; its latents' mean and std then set shift_factor and
  scaling_factor, as SD3's VAE config has them;
- the MMDiT (6 blocks, 8 heads of 16 channels: 3.5M parameters, 14 MB), trained by rectified
  flow matching on the VAE's latents of a fixed pool of renders, encoded once with their
  prompts' embeddings: for a latent z, noise e and t ~ sigmoid(N(0, 1)), it predicts e - z at
  (1 - t) z + t e (the velocity diffusers' FlowMatchEulerDiscreteScheduler integrates); one
  prompt in twenty is replaced by the empty one, so classifier-free guidance has an
  unconditional model. The learning rate warms up, then decays on a cosine; the checkpoint
  holds the weights' EMA.
Every batch is a function of (seed, step); with --threads 1 the run is deterministic on a
CPU (tests/models/test_micro.py pins its first steps).

Measured for the shipped weights (defaults, one thread, the other core busy with light work):
the VAE, 800 steps at 0.40 s, round-trips every held-out render right; the pool of 8,192
renders takes 36 s; the MMDiT takes 0.43 s a step, 7,000 steps in 50 minutes, loss 2.33 ->
0.26. Held-out accuracy of its samples (scripts/eval_micro.py: 300 prompts, one image each,
20 Euler steps of the ODE, 50 s on one thread):

    guidance  single  two   counting  colors  position  color_attr  overall
    5         0.32    0.00  0.26      0.60    0.00      0.00        0.197
    7         0.36    0.04  0.26      0.58    0.00      0.00        0.207

It draws the prompt's colours in the right number of blobs and often the right shape, but
rarely two different objects and never a relation: room for a recipe to teach. What moved it
(earlier runs): width, not the token count or the VAE. 4 heads (64 channels, 7,000 steps)
reached 7.7%; 8 heads for 4,000 steps 14.3%; patch size 1 about 10%. This VAE decodes 94% of
150 held-out renders right even with Gaussian noise of std 0.5 added to their scaled latents
(a KL weight of 1e-4 instead of 1e-6 drops that to 23%).
"""

from __future__ import annotations

import argparse
import json
import time

import torch
import torch.nn.functional as F

from omni import scenes, seeding
from omni.data.prompts import Prompt
from omni.models.sd3 import SCHEDULER
from omni.models.tiny_parts import clip_encoder, clip_tokenizer, save_pipeline, t5_encoder, t5_tokenizer
from omni.pretraining import progress_and_snapshots, train_with_ema

TEXT_LENGTH = 16  # T5's tokens: a scene word is one sentencepiece
# CLIP's: the written-out BPE merges of omni.models.tiny_parts split some scene words (a merge
# of another word, such as "an", fires inside "triangle" first), so a prompt takes up to ~22.
CLIP_LENGTH = 32
VAE_CHANNELS = (16, 32, 32)  # three levels: factor 4
TRANSFORMER = dict(
    sample_size=16,
    patch_size=2,
    in_channels=4,
    num_layers=6,
    attention_head_dim=16,
    num_attention_heads=8,
    joint_attention_dim=64,
    caption_projection_dim=128,
    pooled_projection_dim=64,
    out_channels=4,
    pos_embed_max_size=16,
)
KL_WEIGHT = 1e-6


def micro_pipeline(
    seed: int,
    layers: int = TRANSFORMER["num_layers"],
    heads: int = TRANSFORMER["num_attention_heads"],
    patch_size: int = TRANSFORMER["patch_size"],
):
    """The untrained micro pipeline, identical for identical seeds."""
    from diffusers import (
        AutoencoderKL,
        FlowMatchEulerDiscreteScheduler,
        SD3Transformer2DModel,
        StableDiffusion3Pipeline,
    )

    words = scenes.WORDS
    clip_tok, t5_tok = clip_tokenizer(CLIP_LENGTH, words), t5_tokenizer(TEXT_LENGTH, words)
    torch.manual_seed(seed)
    vae = AutoencoderKL(
        in_channels=3,
        out_channels=3,
        down_block_types=("DownEncoderBlock2D",) * len(VAE_CHANNELS),
        up_block_types=("UpDecoderBlock2D",) * len(VAE_CHANNELS),
        block_out_channels=VAE_CHANNELS,
        layers_per_block=1,
        latent_channels=4,
        norm_num_groups=8,
        sample_size=64,
        use_quant_conv=False,
        use_post_quant_conv=False,
        shift_factor=0.0,
        scaling_factor=1.0,
    )
    torch.manual_seed(seed + 1)
    transformer = SD3Transformer2DModel(
        **{
            **TRANSFORMER,
            "num_layers": layers,
            "num_attention_heads": heads,
            "caption_projection_dim": heads * TRANSFORMER["attention_head_dim"],
            "patch_size": patch_size,
        }
    )
    return StableDiffusion3Pipeline(
        transformer=transformer,
        scheduler=FlowMatchEulerDiscreteScheduler(**SCHEDULER),
        vae=vae,
        text_encoder=clip_encoder(clip_tok, seed + 2),
        tokenizer=clip_tok,
        text_encoder_2=clip_encoder(clip_tok, seed + 3),
        tokenizer_2=clip_tokenizer(CLIP_LENGTH, words),
        text_encoder_3=t5_encoder(t5_tok, seed + 4, TRANSFORMER["joint_attention_dim"]),
        tokenizer_3=t5_tok,
    )


def scene_batch(items, step: int, batch: int, size: int, seed: int):
    """Step `step`'s prompts and renders: items taken in a seeded order, each drawn with its own seed."""
    order = torch.randperm(
        len(items), generator=seeding.seeded_generator(seed, step // (len(items) // batch), seeding.MINIBATCHES)
    )
    start = (step % (len(items) // batch)) * batch
    picked = [items[int(i)] for i in order[start : start + batch]]
    images = torch.stack(
        [
            scenes.render(item, size, seeding.derive_seed(seed, step * batch + k, seeding.SCENE_IMAGES))
            for k, item in enumerate(picked)
        ]
    )
    return [item["prompt"] for item in picked], images


def train_vae(vae, items, args) -> list:
    optimizer = torch.optim.AdamW(vae.parameters(), lr=args.lr)
    losses = []
    for step in range(args.vae_steps):
        _, images = scene_batch(items, step, args.vae_batch, args.size, args.seed)
        x = images * 2 - 1
        posterior = vae.encode(x).latent_dist
        recon = vae.decode(posterior.sample(generator=torch.Generator().manual_seed(step))).sample
        loss = F.mse_loss(recon, x) + KL_WEIGHT * posterior.kl().mean()
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(float(loss.detach()))
    return losses


@torch.no_grad()
def set_latent_scale(vae, items, args) -> None:
    """shift_factor and scaling_factor: the latents' mean and 1 / std over a few batches."""
    z = torch.cat(
        [vae.encode(scene_batch(items, s, 32, args.size, args.seed + 1)[1] * 2 - 1).latent_dist.mean for s in range(4)]
    )
    vae.register_to_config(shift_factor=float(z.mean()), scaling_factor=float(1 / z.std()))


@torch.no_grad()
def vae_round_trip(vae, size: int) -> float:
    """scene_geneval's accuracy on 60 held-out renders after encoding and decoding: what the
    VAE leaves of the scenes bounds what a transformer on its latents can reach."""
    from omni.rewards.scene_geneval import SceneGeneval, SceneGenevalOptions

    items = scenes.held_out_prompts()[::5]
    images = torch.stack([scenes.render(item, size, i) for i, item in enumerate(items)])
    decoded = (vae.decode(vae.encode(images * 2 - 1).latent_dist.mean).sample / 2 + 0.5).clamp(0, 1)
    prompts = [Prompt(item["prompt"], item) for item in items]
    return float(
        SceneGeneval("scene_geneval", SceneGenevalOptions()).score_details(decoded, prompts)[1]["accuracy"].mean()
    )


@torch.no_grad()
def latent_pool(pipe, items, args):
    """The transformer's training set, computed once: `args.pool` renders (items in turn, each
    drawn with its own seed) as scaled VAE latents, and each distinct prompt's embeddings
    (plus the empty prompt's, index 0). Drawing and encoding a fresh batch was a third of a
    step; a fixed pool of a few thousand scenes is enough for a model this small."""
    vae = pipe.vae
    picked = [items[i % len(items)] for i in range(args.pool)]
    texts = [""] + sorted({item["prompt"] for item in picked})
    latents = []
    for start in range(0, args.pool, 64):
        chunk = picked[start : start + 64]
        images = torch.stack(
            [scenes.render(item, args.size, args.seed * 1_000_003 + start + k) for k, item in enumerate(chunk)]
        )
        latents.append(
            (vae.encode(images * 2 - 1).latent_dist.mean - vae.config.shift_factor) * vae.config.scaling_factor
        )
    embeds, pooled = [], []
    for start in range(0, len(texts), 256):
        e, _, p, _ = pipe.encode_prompt(
            prompt=texts[start : start + 256],
            prompt_2=None,
            prompt_3=None,
            do_classifier_free_guidance=False,
            max_sequence_length=TEXT_LENGTH,
        )
        embeds.append(e)
        pooled.append(p)
    index = {text: i for i, text in enumerate(texts)}
    return (
        torch.cat(latents),
        torch.tensor([index[item["prompt"]] for item in picked]),
        torch.cat(embeds),
        torch.cat(pooled),
    )


def flow_matching_loss(transformer, pool, step: int, args):
    """Step `step`'s loss on a batch of the pool: rectified flow at t ~ sigmoid(N(0, 1)), a
    share `args.uncond` of the prompts replaced by the empty one (index 0)."""
    latents, prompt_index, embeds, pooled = pool
    g = torch.Generator().manual_seed(args.seed * 7919 + step)
    picked = torch.randint(len(latents), (args.batch,), generator=g)
    z, text = latents[picked], prompt_index[picked]
    text = torch.where(torch.rand(args.batch, generator=g) < args.uncond, torch.zeros_like(text), text)
    noise = torch.randn(z.shape, generator=g)
    t = torch.sigmoid(torch.randn(args.batch, generator=g))[:, None, None, None]
    pred = transformer(
        hidden_states=(1 - t) * z + t * noise,
        encoder_hidden_states=embeds[text],
        pooled_projections=pooled[text],
        timestep=t.flatten() * 1000,
    ).sample
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
    parser.add_argument("--vae-steps", type=int, default=800)
    parser.add_argument(
        "--vae-from",
        help="take the VAE of this checkpoint (one this script wrote with the same "
        "--seed and --vae-steps: the same weights) instead of training it",
    )
    parser.add_argument("--steps", type=int, default=7000, help="transformer steps")
    parser.add_argument("--batch", type=int, default=32, help="transformer batch")
    parser.add_argument("--pool", type=int, default=8192, help="renders whose latents the transformer trains on")
    parser.add_argument("--layers", type=int, default=TRANSFORMER["num_layers"])
    parser.add_argument(
        "--heads", type=int, default=TRANSFORMER["num_attention_heads"], help="attention heads of 16 channels"
    )
    parser.add_argument(
        "--patch-size", type=int, default=TRANSFORMER["patch_size"], help="latent pixels a token side covers"
    )
    parser.add_argument("--vae-batch", type=int, default=16)
    parser.add_argument("--size", type=int, default=64)
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--warmup", type=int, default=200)
    parser.add_argument("--ema", type=float, default=0.999)
    parser.add_argument("--uncond", type=float, default=0.05, help="share of prompts replaced by the empty one")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument(
        "--save-every", type=int, default=0, help="also write out_dir-stepN every N steps (EMA weights)"
    )
    return parser.parse_args(argv)


def prepare(args):
    """The pipeline with its VAE trained (or taken from --vae-from), and the training pool."""
    torch.set_num_threads(args.threads)
    torch.use_deterministic_algorithms(True)
    pipe = micro_pipeline(args.seed, args.layers, args.heads, args.patch_size)
    items = scenes.training_prompts(4096, args.seed)
    report = {
        "vae_parameters": sum(p.numel() for p in pipe.vae.parameters()),
        "transformer_parameters": sum(p.numel() for p in pipe.transformer.parameters()),
    }
    start = time.perf_counter()
    if args.vae_from:
        from diffusers import AutoencoderKL

        pipe.vae.load_state_dict(AutoencoderKL.from_pretrained(args.vae_from, subfolder="vae").state_dict())
        pipe.vae.register_to_config(
            **{
                k: AutoencoderKL.load_config(args.vae_from, subfolder="vae")[k]
                for k in ("shift_factor", "scaling_factor")
            }
        )
    else:
        vae_losses = train_vae(pipe.vae, items, args)
        report["vae_s_per_step"] = (time.perf_counter() - start) / max(args.vae_steps, 1)
        report["vae_loss_first_last"] = [vae_losses[:1], vae_losses[-5:]]
        set_latent_scale(pipe.vae, items, args)
        report["vae_round_trip_accuracy"] = vae_round_trip(pipe.vae, args.size)
    pipe.vae.requires_grad_(False)
    start = time.perf_counter()
    pool = latent_pool(pipe, items, args)
    report["pool_s"] = time.perf_counter() - start
    return pipe, pool, report


def main() -> None:
    args = parse_args()
    pipe, pool, report = prepare(args)
    start = time.perf_counter()

    on_step = progress_and_snapshots(pipe, args, 100, start)
    losses = train_transformer(pipe, pool, args, on_step)
    report["transformer_s_per_step"] = (time.perf_counter() - start) / max(args.steps, 1)
    report["loss_first_last"] = [losses[:1], losses[-5:]]
    save_pipeline(pipe, args.out_dir)
    print(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
