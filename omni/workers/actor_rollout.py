"""The actor-rollout worker: the trained transformer (FSDP + PEFT LoRA) and a rollout engine.

It is the one place that touches several config groups. Per step it samples with its engine,
re-scores the stored trajectory with the actor, takes the Flow-GRPO update, then hands the
new LoRA to the engine through `omni.fsdp_utils.collect_lora_params`.
"""

from __future__ import annotations

import contextlib
import time
from typing import Dict, List, Optional, Sequence

import torch
from omegaconf import DictConfig

from omni.algorithms import dpo, flow_grpo
from omni.distributed import destroy_process_group, init_process_group, pick_device
from omni.fsdp_utils import collect_lora_params
from omni.models.sd3 import PromptEmbeds, predict_velocity
from omni.rollout.base import RolloutBatch, SamplingOptions
from omni.rollout.sde import sde_step
from omni.weights import add_lora_adapter, module_lora_names
from omni.workers.sharding import clip_grad_norm, wrap_fsdp


def torch_dtype(name: str, device: torch.device) -> torch.dtype:
    if name == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[name]


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


def minibatch_rows(n_samples: int, sde_steps, num_minibatches: int, seed: int, first_sample: int = 0):
    """(samples, steps) of each minibatch of one pass over a batch of `n_samples` trajectories.

    Every sample's SDE steps are shuffled by a generator of its own, seeded by `seed` and the
    sample's index in the whole batch (`first_sample` + i), and minibatch m takes the m-th
    share of each sample's steps. A worker holding a shard of the samples therefore holds the
    same share of every minibatch as the others, and the union over workers is exactly the
    minibatch one worker builds from the whole batch: sharding does not change the update.
    """
    start, stop = sde_steps
    samples: List[List[torch.Tensor]] = [[] for _ in range(num_minibatches)]
    steps: List[List[torch.Tensor]] = [[] for _ in range(num_minibatches)]
    for i in range(n_samples):
        generator = torch.Generator().manual_seed((seed * 1_000_003 + first_sample + i) % 2**63)
        order = torch.randperm(stop - start, generator=generator) + start
        for m, share in enumerate(order.tensor_split(num_minibatches)):
            samples[m].append(torch.full_like(share, i))
            steps[m].append(share)
    minibatches = [(torch.cat(s), torch.cat(j)) for s, j in zip(samples, steps)]
    return [(s, j) for s, j in minibatches if len(s)]


class ActorRolloutWorker:
    def __init__(self, cfg: DictConfig, model_path: str, rank: int = 0, world_size: int = 1, local_rank: int = 0):
        """`rank` and `world_size` place the worker in the actor's process group;
        `local_rank` is its device index on its machine."""
        self.cfg = cfg
        self.rank, self.world_size = rank, world_size
        self.device = pick_device(cfg.trainer.device, local_rank)
        self.dtype = torch_dtype(cfg.model.dtype, self.device)
        self.model_path = model_path
        self.lora_cfg = cfg.model.lora
        self.base_synced = False

    # ----------------------------------------------------------------- set-up
    def setup(self) -> None:
        from diffusers import SD3Transformer2DModel

        fsdp_version = self.cfg.model.fsdp.version if self.world_size > 1 else 0
        if self.world_size > 1:
            init_process_group(self.rank, self.world_size, self.device)
        torch.manual_seed(self.cfg.seed)
        actor = SD3Transformer2DModel.from_pretrained(self.model_path, subfolder="transformer", torch_dtype=self.dtype)
        actor.requires_grad_(False)
        add_lora_adapter(actor, self.lora_cfg)
        self.actor = wrap_fsdp(actor, fsdp_version, self.cfg.model.fsdp.layer_prefixes, self.device)
        self.trainable = [p for p in self.actor.parameters() if p.requires_grad]
        self.optimizer = torch.optim.AdamW(
            self.trainable, lr=self.cfg.trainer.lr, weight_decay=self.cfg.trainer.weight_decay
        )
        self.engine = self._build_engine()
        self.sync_weights()

    def _build_engine(self):
        from omni.rollout import build_engine

        return build_engine(self.cfg, self.model_path, self.device, self.dtype)

    # ----------------------------------------------------------------- sync
    def sync_weights(self) -> Dict[str, float]:
        """Push the actor's weights into the engine: the base first if the engine has none,
        then the LoRA of the configured adapter."""
        start = time.perf_counter()
        sent = 0
        for base_sync_done in ([False, True] if not self.engine.has_base else [True]):
            tensors = collect_lora_params(
                self.actor,
                layered_summon=self.cfg.rollout.layered_summon and base_sync_done,
                base_sync_done=base_sync_done,
                is_diffusers=True,
                adapter_name=self.lora_cfg.adapter_name,
                layer_prefixes=tuple(self.cfg.model.fsdp.layer_prefixes),
            )
            self.engine.update_weights(tensors, base_sync_done=base_sync_done, lora=self.lora_cfg)
            sent += sum(t.numel() * t.element_size() for t in tensors.values())
        return {"sync/seconds": time.perf_counter() - start, "sync/megabytes": sent / 2**20}

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

    # ----------------------------------------------------------------- state
    def optimizer_state_dict(self) -> dict:
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict

        options = StateDictOptions(full_state_dict=True, cpu_offload=True)
        return get_optimizer_state_dict(self.actor, self.optimizer, options=options)

    def load_state(self, lora: Dict[str, torch.Tensor], optimizer_state: dict) -> None:
        """Restore the LoRA (PEFT names) and the optimizer, then sync the engine."""
        from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict, set_optimizer_state_dict

        adapter = self.lora_cfg.adapter_name
        expected = set(self.lora_state_dict())
        if set(lora) != expected:
            raise KeyError(
                f"checkpoint LoRA does not match adapter '{adapter}': missing {sorted(expected - set(lora))[:5]}, "
                f"unexpected {sorted(set(lora) - expected)[:5]}"
            )
        set_model_state_dict(self.actor, module_lora_names(lora, adapter), options=StateDictOptions(full_state_dict=True, strict=False))
        set_optimizer_state_dict(self.actor, self.optimizer, optimizer_state, options=StateDictOptions(full_state_dict=True))
        self.sync_weights()

    # ----------------------------------------------------------------- rollout
    def generate(self, prompts: Sequence[str], seeds: Sequence[int], options: SamplingOptions) -> RolloutBatch:
        return self.engine.generate(prompts, seeds, options)

    # ----------------------------------------------------------------- update
    def score_rows(self, batch: RolloutBatch, samples: torch.Tensor, steps: torch.Tensor, with_reference: bool):
        """Actor log-probs of the stored transitions (sample i, step j) -> (log_prob, kl)."""
        opts = batch.options
        latents = batch.latents[samples, steps].to(self.device, self.dtype)
        next_latents = batch.latents[samples, steps + 1].to(self.device, self.dtype)
        sigma, sigma_next = batch.sigmas[steps], batch.sigmas[steps + 1]
        cond: PromptEmbeds = batch.cond.apply(lambda t: t[samples].to(self.device, self.dtype))
        sigma_max = float(batch.sigmas[1])

        def step_under_current_weights():
            velocity = predict_velocity(self.actor, latents, sigma.to(self.device), cond, opts.guidance_scale)
            return sde_step(velocity, latents, sigma, sigma_next, sigma_max, opts.noise_level, next_sample=next_latents)

        _, log_prob, mean, scale = step_under_current_weights()
        if not with_reference:
            return log_prob.float(), torch.zeros_like(log_prob, dtype=torch.float32)
        with torch.no_grad(), adapters_disabled(self.actor):
            _, _, ref_mean, _ = step_under_current_weights()
        return log_prob.float(), flow_grpo.gaussian_step_kl(mean.float(), ref_mean.float(), scale.float())

    def update(self, batch: RolloutBatch, advantages: torch.Tensor, seed: int, first_sample: int = 0) -> Dict[str, float]:
        """Flow-GRPO update on every (sample, SDE step) transition of the batch: each inner
        epoch is `num_minibatches` optimizer steps (see `minibatch_rows`). A worker of a
        group passes the index of its first sample in the whole batch as `first_sample`."""
        algo = self.cfg.algorithm
        totals: Dict[str, List[float]] = {}
        self.actor.train()
        for epoch in range(algo.num_inner_epochs):
            plan = minibatch_rows(len(batch), batch.options.sde_steps, algo.num_minibatches, seed * 1_009 + epoch, first_sample)
            for samples, steps in plan:
                metrics = self._minibatch_step(batch, advantages, samples, steps)
                for key, value in metrics.items():
                    totals.setdefault(key, []).append(value)
        return {key: sum(values) / len(values) for key, values in totals.items()}

    def _minibatch_step(self, batch, advantages, samples, steps) -> Dict[str, float]:
        algo = self.cfg.algorithm
        sums = {"loss": 0.0, "kl": 0.0, "clip_fraction": 0.0, "ratio": 0.0}
        self.optimizer.zero_grad(set_to_none=True)
        for rows in torch.arange(len(samples)).split(self.cfg.trainer.micro_batch_size):
            s, j = samples[rows], steps[rows]
            log_prob, kl = self.score_rows(batch, s, j, with_reference=algo.kl_coef > 0)
            old_log_prob = batch.log_probs[s, j].to(log_prob.device)
            adv = advantages[s].to(log_prob.device)
            policy_loss, ratio, clip_fraction = flow_grpo.clipped_policy_loss(log_prob, old_log_prob, adv, algo.clip_range)
            loss = policy_loss + algo.kl_coef * kl.mean()
            weight = len(rows) / len(samples)  # the mean over this worker's rows; FSDP averages the workers
            (loss * weight).backward()
            for key, value in (("loss", loss), ("kl", kl.mean()), ("clip_fraction", clip_fraction), ("ratio", ratio.mean())):
                sums[key] += float(value.detach()) * weight
        grad_norm = clip_grad_norm(self.actor, self.trainable, self.cfg.trainer.max_grad_norm)
        self.optimizer.step()
        return {**sums, "grad_norm": float(grad_norm)}

    # ----------------------------------------------------------------- DPO
    def dpo_outputs(self, x0_chosen, x0_rejected, cond: PromptEmbeds, sigmas, noise):
        """Diffusion-DPO loss and metrics for pairs sharing noise level and noise."""
        n = len(x0_chosen)
        to = lambda t: t.to(self.device, self.dtype)  # noqa: E731
        x0 = to(torch.cat([x0_chosen, x0_rejected]))
        noise2, sigmas2 = to(torch.cat([noise, noise])), torch.cat([sigmas, sigmas]).to(self.device)
        cond2 = cond.apply(lambda t: to(torch.cat([t, t])))
        noisy, target = dpo.noisy_latents(x0, noise2, sigmas2), dpo.velocity_target(x0, noise2)
        policy_err = dpo.per_sample_mse(predict_velocity(self.actor, noisy, sigmas2, cond2, 1.0), target)
        with torch.no_grad(), adapters_disabled(self.actor):
            ref_err = dpo.per_sample_mse(predict_velocity(self.actor, noisy, sigmas2, cond2, 1.0), target)
        return dpo.diffusion_dpo_loss(policy_err[:n], policy_err[n:], ref_err[:n], ref_err[n:], self.cfg.algorithm.beta)

    def dpo_noise(self, shape: torch.Size, seed: int):
        """Noise levels and noise of `shape[0]` pairs of latents of `shape[1:]`."""
        algo = self.cfg.algorithm
        generator = torch.Generator().manual_seed(seed)
        sigmas = dpo.sample_sigmas(shape[0], algo.sigma_sampling, generator, algo.logit_mean, algo.logit_std)
        return sigmas, torch.randn(shape, generator=generator)

    def dpo_update(
        self, x0_chosen, x0_rejected, cond: PromptEmbeds, seed: int, first_pair: int = 0, total_pairs: Optional[int] = None
    ) -> Dict[str, float]:
        """One optimizer step of Diffusion-DPO over the pairs, in micro-batches of pairs. A
        worker of a group holds pairs [first_pair, first_pair + n) of `total_pairs`: it draws
        the whole batch's noise and keeps its rows, so the split does not change the noise."""
        n = len(x0_chosen)
        rows_of_batch = slice(first_pair, first_pair + n)
        sigmas, noise = self.dpo_noise((total_pairs or n, *x0_chosen.shape[1:]), seed)
        sigmas, noise = sigmas[rows_of_batch], noise[rows_of_batch]
        self.actor.train()
        self.optimizer.zero_grad(set_to_none=True)
        sums: Dict[str, float] = {}
        for rows in torch.arange(n).split(max(1, self.cfg.trainer.micro_batch_size // 2)):
            out = self.dpo_outputs(x0_chosen[rows], x0_rejected[rows], cond.apply(lambda t: t[rows]), sigmas[rows], noise[rows])
            (out["loss"] * len(rows) / n).backward()
            for key, value in out.items():
                sums[key] = sums.get(key, 0.0) + float(value.detach()) * len(rows) / n
        sums["grad_norm"] = float(clip_grad_norm(self.actor, self.trainable, self.cfg.trainer.max_grad_norm))
        self.optimizer.step()
        return sums

    @torch.no_grad()
    def dpo_evaluate(self, x0_chosen, x0_rejected, cond: PromptEmbeds, seed: int) -> Dict[str, float]:
        sigmas, noise = self.dpo_noise(x0_chosen.shape, seed)
        return {k: float(v) for k, v in self.dpo_outputs(x0_chosen, x0_rejected, cond, sigmas, noise).items()}

    def shutdown(self) -> None:
        self.engine.shutdown()
        if self.world_size > 1:
            destroy_process_group()
