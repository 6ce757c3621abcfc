"""Pretrain a micro Stable Diffusion 3 on rendered scenes (omni.scenes): a FIRST VERSION, to
size the design and measure its speed; it writes a diffusers checkpoint, but no weights ship yet.

    python scripts/pretrain_micro.py /tmp/micro --vae-steps 800 --steps 1500 --threads 1

The pipeline is the tiny SD3's layout with parts sized for scenes:
- tokenizers whose vocabulary holds every scene word (omni.scenes.WORDS; T5 gives each word
  one token, CLIP splits some), frozen random CLIP and T5 encoders (the transformer learns
  to read them);
- a VAE of three levels (a 64 px scene is a 16 x 16 x 4 latent; the tiny SD3's four levels
  leave a 12 px shape about one latent pixel), trained first on renders: reconstruction
  error plus a small KL term; its latents' mean and std then set shift_factor and
  scaling_factor, as SD3's VAE config has them;
- the MMDiT, trained by rectified flow matching on the VAE's latents of renders: for a
  latent z, noise e and t ~ sigmoid(N(0, 1)), it predicts e - z at (1 - t) z + t e (the
  velocity diffusers' FlowMatchEulerDiscreteScheduler integrates); one prompt in ten is
  replaced by the empty one, so classifier-free guidance has an unconditional model.
Every batch is a function of (seed, step): scenes from omni.scenes.training_prompts, each
drawn with its own seed; with --threads 1 the run is deterministic on a CPU.

Measured (defaults, one thread of a shared 2-core machine): the VAE takes 0.50 s a step and
its 800 steps reach a round trip right on all 60 held-out renders; the transformer takes
0.31 s a step (a third of it drawing and encoding the batch) and after its 1,500 steps
(8 minutes) samples (20 Euler steps, guidance 4.5-7) put coloured blobs on the grey but not
yet shapes: 0-3% held-out accuracy on 60 prompts, far below the 15-60% the issue aims at.
Next: latents of a fixed pool of renders cached once, more transformer steps, a wider model.
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

TEXT_LENGTH = 16  # T5's tokens: a scene word is one sentencepiece
# CLIP's: the written-out BPE merges of omni.models.tiny_parts split some scene words (a merge
# of another word, such as "an", fires inside "triangle" first), so a prompt takes up to ~22.
CLIP_LENGTH = 32
VAE_CHANNELS = (16, 32, 32)  # three levels: factor 4
TRANSFORMER = dict(sample_size=16, patch_size=2, in_channels=4, num_layers=4, attention_head_dim=16, num_attention_heads=4,
                   joint_attention_dim=64, caption_projection_dim=64, pooled_projection_dim=64, out_channels=4, pos_embed_max_size=16)
KL_WEIGHT = 1e-6
UNCONDITIONAL = 0.1  # share of prompts replaced by "" in training


def micro_pipeline(seed: int):
    """The untrained micro pipeline, identical for identical seeds."""
    from diffusers import AutoencoderKL, FlowMatchEulerDiscreteScheduler, SD3Transformer2DModel, StableDiffusion3Pipeline

    words = scenes.WORDS
    clip_tok, t5_tok = clip_tokenizer(CLIP_LENGTH, words), t5_tokenizer(TEXT_LENGTH, words)
    torch.manual_seed(seed)
    vae = AutoencoderKL(in_channels=3, out_channels=3, down_block_types=("DownEncoderBlock2D",) * len(VAE_CHANNELS),
                        up_block_types=("UpDecoderBlock2D",) * len(VAE_CHANNELS), block_out_channels=VAE_CHANNELS,
                        layers_per_block=1, latent_channels=4, norm_num_groups=8, sample_size=64,
                        use_quant_conv=False, use_post_quant_conv=False, shift_factor=0.0, scaling_factor=1.0)
    torch.manual_seed(seed + 1)
    transformer = SD3Transformer2DModel(**TRANSFORMER)
    return StableDiffusion3Pipeline(
        transformer=transformer, scheduler=FlowMatchEulerDiscreteScheduler(**SCHEDULER), vae=vae,
        text_encoder=clip_encoder(clip_tok, seed + 2), tokenizer=clip_tok,
        text_encoder_2=clip_encoder(clip_tok, seed + 3), tokenizer_2=clip_tokenizer(CLIP_LENGTH, words),
        text_encoder_3=t5_encoder(t5_tok, seed + 4, TRANSFORMER["joint_attention_dim"]), tokenizer_3=t5_tok,
    )


def scene_batch(items, step: int, batch: int, size: int, seed: int):
    """Step `step`'s prompts and renders: items taken in a seeded order, each drawn with its own seed."""
    order = torch.randperm(len(items), generator=seeding.seeded_generator(seed, step // (len(items) // batch), seeding.MINIBATCHES))
    start = (step % (len(items) // batch)) * batch
    picked = [items[int(i)] for i in order[start : start + batch]]
    images = torch.stack([scenes.render(item, size, seeding.derive_seed(seed, step * batch + k, seeding.SCENE_IMAGES)) for k, item in enumerate(picked)])
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
    z = torch.cat([vae.encode(scene_batch(items, s, args.batch, args.size, args.seed + 1)[1] * 2 - 1).latent_dist.mean for s in range(4)])
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
    return float(SceneGeneval("scene_geneval", SceneGenevalOptions()).score_details(decoded, prompts)[1]["accuracy"].mean())


def train_transformer(pipe, items, args) -> list:
    vae, transformer = pipe.vae, pipe.transformer
    optimizer = torch.optim.AdamW(transformer.parameters(), lr=args.lr)
    losses = []
    for step in range(args.steps):
        prompts, images = scene_batch(items, step, args.batch, args.size, args.seed + 2)
        g = seeding.seeded_generator(args.seed, step, seeding.SDE_WINDOW)
        prompts = ["" if torch.rand(1, generator=g) < UNCONDITIONAL else p for p in prompts]
        with torch.no_grad():
            z = (vae.encode(images * 2 - 1).latent_dist.mean - vae.config.shift_factor) * vae.config.scaling_factor
            embeds, _, pooled, _ = pipe.encode_prompt(prompt=prompts, prompt_2=None, prompt_3=None, do_classifier_free_guidance=False,
                                                      max_sequence_length=TEXT_LENGTH)
        noise = torch.randn(z.shape, generator=g)
        t = torch.sigmoid(torch.randn(len(prompts), generator=g))[:, None, None, None]
        pred = transformer(hidden_states=(1 - t) * z + t * noise, encoder_hidden_states=embeds, pooled_projections=pooled,
                           timestep=t.flatten() * 1000).sample
        loss = F.mse_loss(pred, noise - z)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(float(loss.detach()))
    return losses


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out_dir")
    parser.add_argument("--vae-steps", type=int, default=800)
    parser.add_argument("--steps", type=int, default=1500, help="transformer steps")
    parser.add_argument("--batch", type=int, default=32, help="transformer batch")
    parser.add_argument("--vae-batch", type=int, default=16)
    parser.add_argument("--size", type=int, default=64)
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    torch.use_deterministic_algorithms(True)
    pipe = micro_pipeline(args.seed)
    items = scenes.training_prompts(4096, args.seed)
    report = {"vae_parameters": sum(p.numel() for p in pipe.vae.parameters()),
              "transformer_parameters": sum(p.numel() for p in pipe.transformer.parameters())}
    start = time.perf_counter()
    vae_losses = train_vae(pipe.vae, items, args)
    report["vae_s_per_step"] = (time.perf_counter() - start) / max(args.vae_steps, 1)
    set_latent_scale(pipe.vae, items, args)
    report["vae_round_trip_accuracy"] = vae_round_trip(pipe.vae, args.size)
    pipe.vae.requires_grad_(False)
    start = time.perf_counter()
    losses = train_transformer(pipe, items, args)
    report["transformer_s_per_step"] = (time.perf_counter() - start) / max(args.steps, 1)
    report.update(vae_loss_first_last=[vae_losses[:1], vae_losses[-5:]], loss_first_last=[losses[:1], losses[-5:]])
    save_pipeline(pipe, args.out_dir)
    print(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
