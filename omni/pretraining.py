"""The training loop the shipped micro models were pretrained with (scripts/pretrain_micro.py,
scripts/pretrain_micro_kontext.py): AdamW on a flow-matching loss with a linear warm-up and a
cosine decay to a tenth, gradients clipped at norm 1, and an exponential moving average of the
weights that the checkpoint keeps (it samples cleaner than the last weights)."""

from __future__ import annotations

import copy
import math
import time
from typing import Callable, List, Optional

import torch


def learning_rate(step: int, args) -> float:
    """Linear warm-up over `args.warmup` steps, then a cosine decay to a tenth of `args.lr`."""
    if step < args.warmup:
        return args.lr * (step + 1) / args.warmup
    progress = (step - args.warmup) / max(1, args.steps - args.warmup)
    return args.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress)))


def train_with_ema(
    transformer: torch.nn.Module,
    loss_at: Callable[[torch.nn.Module, int], torch.Tensor],
    args,
    on_step: Optional[Callable] = None,
) -> List[float]:
    """`args.steps` AdamW steps of `loss_at(transformer, step)` at `learning_rate`; the
    transformer ends with the weights' moving average (decay `args.ema`, warmed up as
    (1 + step) / (10 + step)). `on_step(step, losses, ema)` hears of each step."""
    ema = copy.deepcopy(transformer).requires_grad_(False)
    optimizer = torch.optim.AdamW(transformer.parameters(), lr=args.lr, weight_decay=0.0)
    losses: List[float] = []
    for step in range(args.steps):
        for group in optimizer.param_groups:
            group["lr"] = learning_rate(step, args)
        loss = loss_at(transformer, step)
        optimizer.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(transformer.parameters(), 1.0)
        optimizer.step()
        decay = min(args.ema, (1 + step) / (10 + step))
        with torch.no_grad():
            for e, p in zip(ema.parameters(), transformer.parameters()):
                e.lerp_(p, 1 - decay)
        losses.append(float(loss.detach()))
        if on_step is not None:
            on_step(step, losses, ema)
    transformer.load_state_dict(ema.state_dict())
    return losses


def progress_and_snapshots(pipe, args, every: int, start: float) -> Callable:
    """An `on_step` that prints the mean loss of each `every` steps and, every
    `args.save_every` steps (0: never), saves the pipeline with the moving average's weights
    beside `args.out_dir` (`<out_dir>-step<N>`), then puts the training weights back."""
    from omni.models.tiny_parts import save_pipeline

    def on_step(step, losses, ema):
        if step % every == every - 1:
            print(
                f"step {step + 1} loss {sum(losses[-every:]) / every:.4f} {time.perf_counter() - start:.0f}s",
                flush=True,
            )
        if args.save_every and (step + 1) % args.save_every == 0:
            current = copy.deepcopy(pipe.transformer.state_dict())
            pipe.transformer.load_state_dict(ema.state_dict())
            save_pipeline(pipe, f"{args.out_dir}-step{step + 1}")
            pipe.transformer.load_state_dict(current)

    return on_step
