"""An exponential moving average of the LoRA (`trainer.ema_decay`), for evaluation and export.

After every training step the average moves towards the trained LoRA:

    ema <- decay * ema + (1 - decay) * lora          (the first step's LoRA starts it)

It averages out the step-to-step noise of online RL updates, so a decay close to 1 gives a
smoother, usually better, model to evaluate and ship than the last iterate (the practice of
Flow-GRPO's and DiffusionNFT's released code). Training itself continues from the raw LoRA.
The average is kept on the driver's CPU as whole tensors in PEFT naming, the form the worker
returns and loads, so it is the same with one worker or a sharded group.
"""

from __future__ import annotations

from typing import Dict, Optional

import torch


class LoraEMA:
    def __init__(self, decay: float):
        if not 0 < decay < 1:
            raise ValueError(f"EMA decay {decay} must be in (0, 1)")
        self.decay = decay
        self.average: Optional[Dict[str, torch.Tensor]] = None

    @torch.no_grad()
    def update(self, lora: Dict[str, torch.Tensor]) -> None:
        if self.average is None:
            self.average = {name: t.detach().float().clone() for name, t in lora.items()}
            return
        if lora.keys() != self.average.keys():
            raise KeyError(f"LoRA tensors changed names: {sorted(set(lora) ^ set(self.average))[:5]}")
        for name, tensor in lora.items():
            self.average[name].mul_(self.decay).add_(tensor.detach().float(), alpha=1 - self.decay)

    def weights(self, like: Dict[str, torch.Tensor]) -> Dict[str, torch.Tensor]:
        """The average in the dtypes of `like` (the trained LoRA), or `like` before any update."""
        if self.average is None:
            return like
        return {name: self.average[name].to(like[name].dtype) for name in like}
