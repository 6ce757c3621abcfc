"""One training step per algorithm, run by `omni.trainer.Trainer`: each takes the step
number and returns its metrics; everything random in it is seeded by (seed, step)."""

from __future__ import annotations


def build_step(trainer):
    name = trainer.cfg.algorithm.name
    if name in ("flow_grpo", "flow_grpo_fast"):
        from omni.steps.flow_grpo import FlowGRPOStep

        return FlowGRPOStep(trainer)
    if name == "dpo":
        from omni.steps.dpo import OfflineDPOStep

        return OfflineDPOStep(trainer)
    if name == "online_dpo":
        from omni.steps.dpo import OnlineDPOStep

        return OnlineDPOStep(trainer)
    raise ValueError(f"algorithm.name={name}: no training step for it")
