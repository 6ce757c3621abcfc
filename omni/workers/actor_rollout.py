"""The actor-rollout worker: the trained transformer (FSDP + PEFT LoRA, or every parameter
with full fine-tuning) and a rollout engine.

It is the one place that touches several config groups. It offers an algorithm generic
primitives: sampling with its engine, the velocity under the policy or the reference, backward,
the optimizer step, and the weight sync that hands the new weights to the engine through
`omni.fsdp_utils.collect_lora_params`. An algorithm's update (`omni.algorithms.<name>.update`)
runs on the worker through `apply_update`.

What trains is `model.lora`: a LoRA (the reference is the same transformer with its LoRA
disabled; a sync sends the LoRA), or, with `model.lora=null`, the whole transformer (the
reference is a frozen copy of the initial transformer, kept only when the algorithm scores
under it; a sync sends every weight).

Snapshots: an algorithm that scores under other fixed policies than the reference (an EMA of
the policy, a reference that moves) names them (`Algorithm.snapshot_adapters`); each is a
second, frozen LoRA adapter on the same transformer, with the trained adapter's configuration,
added before FSDP wraps it, so it shards like the trained one and costs a LoRA's memory, not a
transformer's. The driver sets one from whole LoRA tensors (`load_snapshot`, the tensors
`lora_state_dict` returns: through `set_model_state_dict`, the same path as `load_adapter`,
for no FSDP, FSDP1 and FSDP2); the update scores under it with `velocity(..., snapshot=name)`.
A snapshot named `REFERENCE_SNAPSHOT` is the reference itself (`reference_model`): it starts as
a copy of the untrained adapter (B = 0, so exactly the base, as with the LoRA disabled), and
loading the policy's LoRA into it moves the reference to the current policy (GARDO's reset).
"""

from __future__ import annotations

import contextlib
import copy
import math
import time
from typing import Callable, Dict, Optional, Sequence

import torch

from omni.config.trainer import Optimizer
from omni.devices import torch_dtype
from omni.distributed import destroy_process_group, init_process_group, pick_device
from omni.fsdp_utils import collect_lora_params, state_nbytes
from omni.models import get_family
from omni.models.base import Conditioning
from omni.rollout import build_engine, shares_actor
from omni.rollout.base import RolloutBatch, SamplingOptions
from omni.rollout.parity import ParityGate
from omni.weights import (
    REFERENCE_SNAPSHOT,
    add_lora_adapter,
    add_snapshot_adapter,
    lora_module_names,
    module_lora_names,
)
from omni.workers.sharding import average_gradients, clip_grad_norm, wrap_fsdp


@contextlib.contextmanager
def adapters_disabled(module: torch.nn.Module):
    """The reference policy: the same transformer with its LoRA switched off."""
    from peft.tuners.tuners_utils import BaseTunerLayer

    layers = [m for m in module.modules() if isinstance(m, BaseTunerLayer)]
    for layer in layers:
        layer.enable_adapters(False)
    try:
        yield
    finally:
        for layer in layers:
            layer.enable_adapters(True)


@contextlib.contextmanager
def snapshot_active(module: torch.nn.Module, name: str, trained: str):
    """The transformer with snapshot adapter `name` in place of the trained adapter `trained`;
    every adapter frozen meanwhile, the trained one active and trainable again after."""
    from peft.tuners.tuners_utils import BaseTunerLayer

    layers = [m for m in module.modules() if isinstance(m, BaseTunerLayer)]
    for layer in layers:
        layer.set_adapter(name, inference_mode=True)
    try:
        yield
    finally:
        for layer in layers:
            layer.set_adapter(trained)


class ActorRolloutWorker:
    def __init__(
        self,
        cfg,
        model_path: str,
        rank: int = 0,
        world_size: int = 1,
        local_rank: int = 0,
        keep_reference: bool = False,
        snapshots: Sequence[str] = (),
    ):
        """`rank` and `world_size` place the worker in the actor's process group;
        `local_rank` is its device index on its machine. `keep_reference`: the algorithm
        scores under the reference (`Algorithm.uses_reference`); with full fine-tuning the
        worker then keeps a frozen copy of the initial transformer (a LoRA run needs none).
        `snapshots`: the frozen adapters the algorithm scores under (`Algorithm.snapshot_adapters`,
        see the module docstring); a LoRA run only."""
        self.cfg = cfg
        self.rank, self.world_size = rank, world_size
        self.device = pick_device(cfg.trainer.device, local_rank)
        self.dtype = torch_dtype(cfg.model.dtype, self.device)
        self.model_path = model_path
        self.family = get_family(cfg.model.family)
        self.lora_cfg = cfg.model.lora
        self.full_finetuning = self.lora_cfg is None
        self.keep_reference = keep_reference
        self.snapshots = tuple(snapshots)
        if self.snapshots and self.full_finetuning:
            raise ValueError(f"snapshot adapters {list(self.snapshots)} need a LoRA; model.lora=null trains no adapter")
        self.reference = None  # the frozen initial transformer (full fine-tuning with a reference)

    # ----------------------------------------------------------------- set-up
    def setup(self) -> None:
        fsdp_version = self.cfg.model.fsdp.version if self.world_size > 1 else 0
        self.replicated = self.world_size > 1 and fsdp_version == 0
        if self.world_size > 1:
            init_process_group(self.rank, self.world_size, self.device)
        torch.manual_seed(self.cfg.seed)
        actor = self.family.load_transformer(self.model_path, self.dtype, self.device)
        self.family.apply_settings(actor, self.cfg.model)
        prefixes = self.cfg.model.fsdp.layer_prefixes
        if self.full_finetuning:
            if self.keep_reference:
                reference = copy.deepcopy(actor).requires_grad_(False).eval()
                self.reference = wrap_fsdp(reference, fsdp_version, prefixes, self.device, self.dtype)
            actor.requires_grad_(True)
        else:
            actor.requires_grad_(False)
            add_lora_adapter(actor, self.lora_cfg)
            for name in self.snapshots:
                add_snapshot_adapter(actor, self.lora_cfg, name)
        if self.cfg.model.gradient_checkpointing:
            actor.enable_gradient_checkpointing()  # per block, before FSDP wraps the blocks
        self.actor = wrap_fsdp(actor, fsdp_version, prefixes, self.device, self.dtype)
        self.trainable = [p for p in self.actor.parameters() if p.requires_grad]
        trainer = self.cfg.trainer
        optimizer = torch.optim.SGD if trainer.optimizer == Optimizer.sgd else torch.optim.AdamW
        self.optimizer = optimizer(self.trainable, lr=trainer.lr, weight_decay=trainer.weight_decay)
        shared = self.actor if shares_actor(self.cfg) else None
        self.engine = build_engine(self.cfg, self.family, self.model_path, self.device, self.dtype, actor=shared)
        self.parity = None if self.engine.shares_actor else ParityGate.of_run(self.cfg)
        self.syncs = 0  # weight syncs so far (the parity gate picks some)
        if not (self.full_finetuning and self.engine.has_base):  # else it loaded these very weights
            self.sync_weights()

    # ----------------------------------------------------------------- sync
    def sync_weights(self) -> Dict[str, float]:
        """Push the actor's weights into the engine: with a LoRA, the base first if the
        engine has none, then the LoRA of the configured adapter; with full fine-tuning, the
        whole transformer every time. An engine sampling with the actor's own transformer
        needs none. The syncs `rollout.parity` picks are then checked by the parity gate
        (`omni.rollout.parity`: `ParityError` when the engine samples another policy), whose
        figures (`sync/parity_*`) join the sync's."""
        start = time.perf_counter()
        sent, trained_modules = 0, None
        if self.engine.shares_actor:
            return {"sync/seconds": 0.0, "sync/megabytes": 0.0}
        for base_sync_done in self._sync_kinds():
            tensors = collect_lora_params(
                self.actor,
                layered_summon=self.cfg.rollout.layered_summon and base_sync_done,
                base_sync_done=base_sync_done,
                is_diffusers=True,
                adapter_name=self.lora_cfg.adapter_name if self.lora_cfg else "default",
                layer_prefixes=tuple(self.cfg.model.fsdp.layer_prefixes),
            )
            self.engine.update_weights(tensors, base_sync_done=base_sync_done, lora=self.lora_cfg)
            sent += state_nbytes(tensors)
            if base_sync_done and not self.full_finetuning:
                trained_modules = lora_module_names(tensors)
        metrics = {"sync/seconds": time.perf_counter() - start, "sync/megabytes": sent / 2**20}
        self.syncs += 1
        if self.parity is not None and self.parity.due(self.syncs):
            metrics.update(
                self.parity.check(self.syncs, self.family, self.actor, self.dtype, self.engine, trained_modules)
            )
        return metrics

    def _sync_kinds(self) -> Sequence[bool]:
        """`base_sync_done` of each collection a sync sends (False: the base weights)."""
        if self.full_finetuning:
            return [False]
        return [False, True] if not self.engine.has_base else [True]

    def lora_state_dict(self) -> Dict[str, torch.Tensor]:
        """Whole LoRA tensors in PEFT naming (for checkpoints and export)."""
        return collect_lora_params(
            self.actor,
            layered_summon=False,
            base_sync_done=True,
            is_diffusers=True,
            adapter_name=self.lora_cfg.adapter_name,
            layer_prefixes=tuple(self.cfg.model.fsdp.layer_prefixes),
        )

    def trained_state_dict(self) -> Dict[str, torch.Tensor]:
        """What trains, as whole CPU tensors: the LoRA (PEFT names) or, with full
        fine-tuning, the whole transformer (its plain state_dict names)."""
        if not self.full_finetuning:
            return self.lora_state_dict()
        return collect_lora_params(self.actor, layered_summon=False, base_sync_done=False, is_diffusers=True)

    # ----------------------------------------------------------------- state
    def optimizer_state_dict(self) -> dict:
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict

        options = StateDictOptions(full_state_dict=True, cpu_offload=True)
        return get_optimizer_state_dict(self.actor, self.optimizer, options=options)

    def load_adapter(self, lora: Dict[str, torch.Tensor], sync: bool = True) -> None:
        """Set the LoRA (PEFT names, as `lora_state_dict` returns them), then sync the engine."""
        from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

        adapter = self.lora_cfg.adapter_name
        expected = set(self.lora_state_dict())
        if set(lora) != expected:
            raise KeyError(
                f"LoRA does not match adapter '{adapter}': missing {sorted(expected - set(lora))[:5]}, "
                f"unexpected {sorted(set(lora) - expected)[:5]}"
            )
        set_model_state_dict(
            self.actor, module_lora_names(lora, adapter), options=StateDictOptions(full_state_dict=True, strict=False)
        )
        if sync:
            self.sync_weights()

    def load_snapshot(self, name: str, lora: Dict[str, torch.Tensor]) -> None:
        """Set snapshot adapter `name` to `lora` (PEFT names, as `lora_state_dict` returns
        them); the engine is not synced (it samples with the trained adapter)."""
        from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

        if name not in self.snapshots:
            raise KeyError(f"no snapshot adapter {name!r}: this worker keeps {list(self.snapshots)}")
        expected = set(self.lora_state_dict())
        if set(lora) != expected:
            raise KeyError(
                f"LoRA does not match snapshot '{name}': missing {sorted(expected - set(lora))[:5]}, "
                f"unexpected {sorted(set(lora) - expected)[:5]}"
            )
        set_model_state_dict(
            self.actor, module_lora_names(lora, name), options=StateDictOptions(full_state_dict=True, strict=False)
        )

    def load_transformer(self, weights: Dict[str, torch.Tensor]) -> None:
        """Full fine-tuning: set every weight of the actor (plain names, as
        `trained_state_dict` returns them); strict, so a missing or stray name is an error."""
        from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

        set_model_state_dict(self.actor, weights, options=StateDictOptions(full_state_dict=True, strict=True))

    def load_weights(self, weights: Dict[str, torch.Tensor], sync: bool = True) -> None:
        """Set the trained weights (as `trained_state_dict` returns them: the LoRA, or with full
        fine-tuning the whole transformer), then sync the engine."""
        if self.full_finetuning:
            self.load_transformer(weights)
        else:
            self.load_adapter(weights, sync=False)
        if sync:
            self.sync_weights()

    def load_state(self, weights: Dict[str, torch.Tensor], optimizer_state: dict) -> None:
        """Restore the trained weights (as `trained_state_dict` returns them) and the
        optimizer, then sync the engine. The reference stays the initial transformer."""
        from torch.distributed.checkpoint.state_dict import StateDictOptions, set_optimizer_state_dict

        self.load_weights(weights, sync=False)
        set_optimizer_state_dict(
            self.actor, self.optimizer, optimizer_state, options=StateDictOptions(full_state_dict=True)
        )
        self.sync_weights()

    # ----------------------------------------------------------------- rollout
    def generate(self, prompts: Sequence[str], seeds: Sequence[int], options: SamplingOptions) -> RolloutBatch:
        return self.engine.generate(prompts, seeds, options)

    def encode_prompts(self, prompts: Sequence[str], guidance_scale: float, max_sequence_length: int) -> Conditioning:
        return self.engine.encode_prompts(prompts, guidance_scale, max_sequence_length)

    def encode_images(self, images: torch.Tensor) -> torch.Tensor:
        return self.engine.encode_images(images)

    # ----------------------------------------------------------------- primitives of an update
    def to_device(self, tensor: torch.Tensor) -> torch.Tensor:
        """A latent, noise or embedding on the actor's device, in fp32: an algorithm's math
        around the transformer stays fp32 whatever the compute dtype (`velocity` casts)."""
        return tensor.to(self.device, torch.float32)

    def velocity(
        self,
        latents,
        sigmas,
        cond: Conditioning,
        guidance_scale: float,
        reference: bool = False,
        uncond_grad: bool = True,
        uncond: Optional[torch.Tensor] = None,
        snapshot: Optional[str] = None,
    ) -> torch.Tensor:
        """The actor's velocity (with gradients; under CFG through the unconditional pass
        too unless `uncond_grad=False`, or with the unconditional velocity `uncond` given:
        only the conditional pass runs), the reference's (`reference_model`, no gradients)
        or snapshot adapter `snapshot`'s (no gradients), in fp32; inputs already on the
        device (`to_device`), cast here to the transformer's compute dtype."""
        latents, sigmas = latents.to(self.dtype), sigmas.to(self.device)
        cond = cond.apply(lambda t: t.to(self.dtype))
        if snapshot is not None:
            with torch.no_grad(), self.snapshot_model(snapshot) as model:
                return self.family.predict_velocity(model, latents, sigmas, cond, guidance_scale)
        if uncond is not None and not reference:
            return self.family.guided_velocity(self.actor, latents, sigmas, cond, guidance_scale, uncond=uncond)[0]
        if not reference:
            return self.family.predict_velocity(self.actor, latents, sigmas, cond, guidance_scale, uncond_grad)
        with torch.no_grad(), self.reference_model() as model:
            return self.family.predict_velocity(model, latents, sigmas, cond, guidance_scale)

    @contextlib.contextmanager
    def reference_model(self):
        """The reference policy, the one place it is chosen: the actor with its LoRA disabled,
        the actor with its reference snapshot (`REFERENCE_SNAPSHOT`) when the algorithm keeps
        one, or with full fine-tuning the frozen copy of the initial transformer."""
        if REFERENCE_SNAPSHOT in self.snapshots:
            with self.snapshot_model(REFERENCE_SNAPSHOT) as model:
                yield model
            return
        if not self.full_finetuning:
            with adapters_disabled(self.actor):
                yield self.actor
            return
        if self.reference is None:
            raise RuntimeError(
                "the reference was asked for, but with model.lora=null this worker keeps no copy of the initial "
                "transformer: the algorithm's `uses_reference` must say it scores under the reference"
            )
        yield self.reference

    @contextlib.contextmanager
    def snapshot_model(self, name: str):
        """The actor with snapshot adapter `name` in place of the trained one."""
        if name not in self.snapshots:
            raise KeyError(f"no snapshot adapter {name!r}: this worker keeps {list(self.snapshots)}")
        with snapshot_active(self.actor, name, self.lora_cfg.adapter_name):
            yield self.actor

    def zero_grad(self) -> None:
        self.optimizer.zero_grad(set_to_none=True)

    def backward(self, loss: torch.Tensor, sync: bool = True) -> None:
        """Accumulate the gradient of `loss`. Across a group, gradients are reduced between
        the workers only when `sync` (the last micro-batch before an optimizer step), not
        after every micro-batch."""
        from torch.distributed.fsdp import FullyShardedDataParallel

        if self.replicated:
            loss.backward()
            if sync:
                start = time.perf_counter()
                average_gradients(self.trainable)
                self.allreduce_seconds += time.perf_counter() - start
            return
        if hasattr(self.actor, "set_requires_gradient_sync"):  # FSDP2
            self.actor.set_requires_gradient_sync(sync)
        elif isinstance(self.actor, FullyShardedDataParallel) and not sync:
            with self.actor.no_sync():
                loss.backward()
            return
        loss.backward()

    def set_lr(self, lr: float) -> float:
        """Set the optimizer's learning rate (the trainer's schedule); returns it as set."""
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        return self.optimizer.param_groups[0]["lr"]

    def optimizer_step(self) -> float:
        """Clip the gradient norm and step; returns the norm before clipping. A non-finite
        norm (a NaN or inf loss or gradient) skips the step: the weights and the optimizer
        state keep their values, and the caller sees the norm."""
        grad_norm = float(clip_grad_norm(self.actor, self.trainable, self.cfg.trainer.max_grad_norm))
        if math.isfinite(grad_norm):
            self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        return grad_norm

    def apply_update(self, update: Callable, batch, seed: int, first: int = 0, total: int = 0) -> Dict[str, float]:
        """Run an algorithm's `update(worker, batch, seed, first, total)` on this worker's
        rows [first, first + len(batch)) of a batch of `total` rows (0: this is the batch).
        Its metrics gain the seconds the update took here (`worker_seconds`: the driver's
        `time/update` less the dispatch) and, with a replicated base across workers, those of
        its gradient all-reduces (`allreduce_seconds`; FSDP's collectives run inside the
        forward and backward passes, not timed apart)."""
        self.actor.train()
        self.allreduce_seconds = 0.0
        start = time.perf_counter()
        metrics = update(self, batch, seed, first, total or len(batch))
        metrics["worker_seconds"] = time.perf_counter() - start
        if self.replicated:
            metrics["allreduce_seconds"] = self.allreduce_seconds
        return metrics

    def evaluate_batch(self, evaluate: Callable, batch, seed: int) -> Dict[str, float]:
        """Run an algorithm's `evaluate(worker, batch, seed)` without gradients."""
        with torch.no_grad():
            return evaluate(self, batch, seed)

    def shutdown(self) -> None:
        self.engine.shutdown()
        if self.world_size > 1:
            destroy_process_group()
