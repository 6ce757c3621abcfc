"""Flow-GRPO's update through the real worker on the tiny SD3: the tests that catch a broken
update in seconds (a dropped KL term, a flipped sign, an off-by-one in the training window,
any silent change of the numbers: a pinned 2-step checksum)."""

import itertools

import pytest
import torch

from omni.algorithms import flow_grpo
from omni.context import step_seeds
from omni.trainer import Trainer
from omni.validation import validate
from tests.conftest import compose_config, training_options
from tests.workers.test_actor_rollout import rescore

PROMPTS = ["a red cat", "a blue dog"]


def randomise_lora(worker, seed=0, scale=0.2):
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in worker.trainable:
            p.copy_(torch.randn(p.shape, generator=generator) * scale)
    worker.sync_weights()


def rollout(worker, n=4, step=0):
    prompts = [p for p in PROMPTS for _ in range(n // 2)]
    return worker.generate(prompts, step_seeds(0, step, n), training_options(worker.cfg, step))


def gradients_of_one_update(worker, batch):
    """The gradients the optimizer would apply, per parameter, without stepping."""
    seen = []
    worker.optimizer_step = lambda: seen.append([p.grad.clone() for p in worker.trainable]) or 0.0
    try:
        flow_grpo.update(worker, batch, seed=0)
    finally:
        del worker.optimizer_step
    return [torch.cat([g.flatten() for g in grads]) for grads in seen]


def all_log_probs(worker, batch):
    """(sample, SDE step) log-probs of the batch under the actor's current weights."""
    log_prob, _, _ = rescore(worker, batch, with_reference=False)
    start, stop = batch.options.sde_steps
    return log_prob.reshape(len(batch), stop - start)


def test_positive_kl_coef_changes_the_gradient(fresh):
    randomise_lora(fresh)  # policy != reference, so the KL has a gradient
    batch = flow_grpo.GRPOBatch(rollout(fresh), torch.tensor([1.0, -1.0, 0.5, -0.5]))
    fresh.cfg.algorithm.kl_coef = 0.0
    without = gradients_of_one_update(fresh, batch)
    fresh.cfg.algorithm.kl_coef = 0.5
    with_kl = {}
    for kl_type in ("latent", "velocity"):
        fresh.cfg.algorithm.kl_type = kl_type
        with_kl[kl_type] = gradients_of_one_update(fresh, batch)
        assert len(without) == len(with_kl[kl_type]) == fresh.cfg.algorithm.num_minibatches
        for a, b in zip(without, with_kl[kl_type]):
            assert (a - b).norm() > 1e-3 * a.norm(), kl_type
    for a, b in zip(with_kl["latent"], with_kl["velocity"]):  # the two penalties pull differently
        assert (a - b).norm() > 1e-3 * a.norm()


def test_update_raises_log_prob_of_positive_advantage_and_lowers_negative(fresh):
    batch = rollout(fresh, n=2)
    before = all_log_probs(fresh, batch).mean(dim=1)
    fresh.apply_update(flow_grpo.update, flow_grpo.GRPOBatch(batch, torch.tensor([1.0, -1.0])), seed=0)
    after = all_log_probs(fresh, batch).mean(dim=1)
    assert after[0] > before[0] and after[1] < before[1], (before, after)


@pytest.mark.parametrize("window", [(0, 10), (0, 2), (3, 5), (8, 10), (4, 5)])
@pytest.mark.parametrize("n_samples,num_minibatches,first", [(1, 1, 0), (4, 2, 0), (3, 2, 5), (6, 3, 2)])
def test_minibatch_plan_covers_each_window_transition_once(window, n_samples, num_minibatches, first):
    plan = flow_grpo.minibatch_rows(n_samples, window, num_minibatches, seed=11, first_sample=first)
    pairs = [(int(s), int(j)) for samples, steps in plan for s, j in zip(samples, steps)]
    expected = set(itertools.product(range(n_samples), range(*window)))
    assert len(pairs) == len(set(pairs)) and set(pairs) == expected
    assert len(plan) == min(num_minibatches, window[1] - window[0])


def test_minibatch_plan_of_a_shard_is_the_shard_of_the_plan():
    """Sharding does not change the update: rows [2, 4) of a 4-sample plan are the plan a
    worker holding those rows builds."""
    whole = flow_grpo.minibatch_rows(4, (0, 6), 2, seed=3)
    shard = flow_grpo.minibatch_rows(2, (0, 6), 2, seed=3, first_sample=2)
    for (ws, wj), (ss, sj) in zip(whole, shard):
        keep = ws >= 2
        assert torch.equal(ws[keep] - 2, ss) and torch.equal(wj[keep], sj)


def test_fast_window_trains_only_its_steps(tiny_cache, tmp_path):
    cfg = validate(compose_config([f"model.cache_dir={tiny_cache}", "algorithm=flow_grpo_fast"], tmp_path))
    for step in range(20):
        start, stop = training_options(cfg, step).sde_steps
        lo, hi = cfg.algorithm.sde_window_range
        assert stop - start == cfg.algorithm.sde_window_size and lo <= start <= hi


# A 2-step run of the default config (8 images a step): statistics of the final LoRA,
# pinned. Its size and its projection on a fixed random direction (which flips with the sign
# of the update). A change to sampling, rewards, advantages, the loss or the optimizer moves
# them far beyond the tolerance (a flipped advantage takes the projection from 3.05 to 0.86);
# floating-point reduction order (threads, CPU) moves them by about 1e-4.
PINNED = {"abs_sum": 336.3841, "projection": 3.0458}
TOLERANCE = {"abs_sum": 0.1, "projection": 0.02}


def lora_statistics(tensors) -> dict:
    flat = torch.cat([t.flatten().double() for _, t in sorted(tensors.items())])
    direction = torch.randn(flat.shape, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    return {"abs_sum": float(flat.abs().sum()), "projection": float((flat * direction).sum())}


def test_two_step_lora_checksum_is_pinned(tiny_cache, tmp_path):
    overrides = [f"model.cache_dir={tiny_cache}", "trainer.steps=2", "trainer.batch_size=8", "algorithm.group_size=4",
                 "eval.images_per_prompt=1", "trainer.progress_bar=false"]  # fmt: skip
    trainer = Trainer(validate(compose_config(overrides, tmp_path)))
    trainer.setup()
    try:
        for step in range(2):
            trainer.algorithm.step(step)
        stats = lora_statistics(trainer.worker.lora_state_dict())
    finally:
        trainer.cleanup()
    for key, value in PINNED.items():
        assert abs(stats[key] - value) < TOLERANCE[key], stats


def test_gradients_are_reduced_once_per_optimizer_step(fresh, monkeypatch):
    """Across a group, only the last micro-batch's backward reduces the gradients (the
    2-worker test checks that the update is then the 1-worker one)."""
    flags = []
    real = fresh.backward
    monkeypatch.setattr(fresh, "backward", lambda loss, sync=True: flags.append(sync) or real(loss, sync))
    monkeypatch.setattr(fresh.cfg.trainer, "micro_batch_size", 7)
    batch = flow_grpo.GRPOBatch(rollout(fresh, n=4), torch.tensor([1.0, -1.0, 0.5, -0.5]))
    flow_grpo.update(fresh, batch, seed=0)  # 2 minibatches of 20 transitions: 3 micro-batches each
    assert flags == [False, False, True] * 2


def test_gradient_checkpointing_gives_the_same_gradients(fresh, tiny_cache, tmp_path):
    from omni.trainer import model_path
    from omni.workers.actor_rollout import ActorRolloutWorker

    cfg = validate(
        compose_config(
            [f"model.cache_dir={tiny_cache}", "trainer.micro_batch_size=64", "model.gradient_checkpointing=true"],
            tmp_path,
        )
    )
    checkpointed = ActorRolloutWorker(cfg, model_path(cfg.model))
    checkpointed.setup()
    hooks = []
    try:
        assert checkpointed.actor.gradient_checkpointing
        randomise_lora(fresh)
        with torch.no_grad():
            for mine, theirs in zip(checkpointed.trainable, fresh.trainable):
                mine.copy_(theirs)
        batch = flow_grpo.GRPOBatch(rollout(fresh), torch.tensor([1.0, -1.0, 0.5, -0.5]))
        calls = {id(fresh): 0, id(checkpointed): 0}
        hooks = [
            w.actor.transformer_blocks[0].register_forward_pre_hook(
                lambda *_, key=id(w): calls.__setitem__(key, calls[key] + 1)
            )
            for w in (fresh, checkpointed)
        ]
        for plain, recomputed in zip(
            gradients_of_one_update(fresh, batch), gradients_of_one_update(checkpointed, batch)
        ):
            assert plain.norm() > 0 and torch.allclose(plain, recomputed, rtol=1e-4, atol=1e-7)
        assert calls[id(checkpointed)] == 2 * calls[id(fresh)] > 0  # the backward recomputed the block
    finally:
        for hook in hooks:
            hook.remove()
        checkpointed.shutdown()


@pytest.mark.parametrize(
    "model,containers",
    [("flux_tiny", ("transformer_blocks", "single_transformer_blocks")), ("qwen_image_tiny", ("transformer_blocks",))],
)
def test_gradient_checkpointing_gives_the_same_gradients_per_family(model, containers, tiny_cache, tmp_path):
    """Each family recomputes every container of blocks (FLUX: its double-stream and its
    single-stream blocks)."""
    from omni.trainer import model_path
    from omni.workers.actor_rollout import ActorRolloutWorker

    workers = []
    try:
        for checkpointing in (False, True):
            overrides = [
                f"model={model}",
                "trainer.micro_batch_size=64",
                f"model.gradient_checkpointing={checkpointing}",
            ]
            cfg = validate(compose_config([f"model.cache_dir={tiny_cache}", *overrides], tmp_path / str(checkpointing)))
            workers.append(ActorRolloutWorker(cfg, model_path(cfg.model)))
            workers[-1].setup()
        plain, checkpointed = workers
        randomise_lora(plain)
        with torch.no_grad():
            for mine, theirs in zip(checkpointed.trainable, plain.trainable):
                mine.copy_(theirs)
        batch = flow_grpo.GRPOBatch(rollout(plain), torch.tensor([1.0, -1.0, 0.5, -0.5]))
        calls = {}
        for w in workers:
            for container in containers:
                key = (id(w), container)
                calls[key] = 0
                getattr(w.actor, container)[0].register_forward_pre_hook(
                    lambda *_, key=key: calls.__setitem__(key, calls[key] + 1)
                )
        for a, b in zip(gradients_of_one_update(plain, batch), gradients_of_one_update(checkpointed, batch)):
            assert a.norm() > 0 and torch.allclose(a, b, rtol=1e-4, atol=1e-7)
        for container in containers:
            assert calls[(id(checkpointed), container)] == 2 * calls[(id(plain), container)] > 0
    finally:
        for w in workers:
            w.shutdown()


def test_conditional_cfg_gradient_is_the_conditional_pass_alone(fresh):
    """algorithm.cfg_gradient=conditional: the same guided velocity (to float rounding: the two
    passes run apart) whose gradient is the conditional pass's alone, that of the guided
    velocity with its unconditional half detached (as flow_grpo's trainers compute it); the
    exact gradient (cfg_gradient=both) differs. The update reads the key."""
    from dataclasses import replace

    randomise_lora(fresh)
    scale = 3.0
    batch = fresh.generate(PROMPTS, [1, 2], replace(training_options(fresh.cfg, 0), guidance_scale=scale))
    latents, sigmas = fresh.to_device(batch.latents[:, 3]), batch.sigmas[[3, 3]]
    weights = torch.randn(latents.shape, generator=torch.Generator().manual_seed(0))

    def value_and_gradient(velocity):
        fresh.zero_grad()
        v = velocity()
        (v * weights).sum().backward()
        return v.detach(), torch.cat([p.grad.flatten() for p in fresh.trainable])

    negatives = replace(batch.cond, embeds=batch.cond.neg_embeds, pooled=batch.cond.neg_pooled)

    def detached_by_hand():
        uncond = fresh.velocity(latents, sigmas, negatives, 1.0).detach()
        return uncond + scale * (fresh.velocity(latents, sigmas, batch.cond, 1.0) - uncond)

    v_both, g_both = value_and_gradient(lambda: fresh.velocity(latents, sigmas, batch.cond, scale))
    v_cond, g_cond = value_and_gradient(lambda: fresh.velocity(latents, sigmas, batch.cond, scale, uncond_grad=False))
    v_hand, g_hand = value_and_gradient(detached_by_hand)
    fresh.zero_grad()
    assert (v_cond - v_both).abs().max() < 1e-5 and (v_cond - v_hand).abs().max() < 1e-6
    assert torch.allclose(g_cond, g_hand, rtol=1e-5, atol=1e-7)
    assert (g_cond - g_both).norm() > 0.05 * g_both.norm()

    grpo_batch = flow_grpo.GRPOBatch(batch, torch.tensor([1.0, -1.0]))
    exact = gradients_of_one_update(fresh, grpo_batch)
    fresh.cfg.algorithm.cfg_gradient = "conditional"
    try:
        conditional = gradients_of_one_update(fresh, grpo_batch)
    finally:
        fresh.cfg.algorithm.cfg_gradient = "both"
    assert all((c - e).norm() > 0.05 * e.norm() for c, e in zip(conditional, exact))


def test_conditional_cfg_gradient_needs_an_unconditional_pass(tiny_cache):
    from omni.validation import ConfigError

    validate(
        compose_config(
            [f"model.cache_dir={tiny_cache}", "algorithm.cfg_gradient=conditional", "rollout.guidance_scale=4.5"]
        )
    )
    for overrides in (["rollout.guidance_scale=1.0"], ["model=flux_tiny", "rollout.guidance_scale=3.5"]):
        with pytest.raises(
            ConfigError, match="algorithm.cfg_gradient=conditional: model.family=.* runs no unconditional pass"
        ):
            validate(
                compose_config([f"model.cache_dir={tiny_cache}", "algorithm.cfg_gradient=conditional", *overrides])
            )


def gradients_of_stepping_update(worker, batch):
    """The gradients of each optimizer step of one update that does step; the LoRA and the
    optimizer state are put back afterwards."""
    lora = [p.detach().clone() for p in worker.trainable]
    optimizer = worker.optimizer.state_dict()
    seen, step = [], worker.optimizer_step

    def record_then_step():
        seen.append(torch.cat([p.grad.flatten() for p in worker.trainable]))
        return step()

    worker.optimizer_step = record_then_step
    try:
        flow_grpo.update(worker, batch, seed=0)
    finally:
        del worker.optimizer_step
        with torch.no_grad():
            for p, saved in zip(worker.trainable, lora):
                p.copy_(saved)
        worker.optimizer.load_state_dict(optimizer)
    return seen


def test_the_first_optimizer_step_takes_the_rollouts_unconditional_velocities(fresh):
    """cfg_gradient=conditional: the rollout keeps each SDE step's unconditional velocity (the
    policy's own: equal to a pass under the current weights; the rollout itself unchanged), and the update's first
    optimizer step uses them instead of a pass of its own; its gradients equal those of
    recomputing them (to float rounding: the rollout ran other batch shapes), and the next
    step, after the weights moved, recomputes them."""
    from dataclasses import replace

    randomise_lora(fresh)
    fresh.cfg.algorithm.cfg_gradient, fresh.engine.keep_uncond = "conditional", True
    try:
        opts = replace(training_options(fresh.cfg, 0), guidance_scale=3.0)
        batch = fresh.generate([p for p in PROMPTS for _ in range(2)], step_seeds(0, 0, 4), opts)
        fresh.engine.keep_uncond = False
        plain = fresh.generate([p for p in PROMPTS for _ in range(2)], step_seeds(0, 0, 4), opts)
        assert plain.uncond_velocities is None and torch.equal(plain.log_probs, batch.log_probs)  # the same passes
        start, stop = opts.sde_steps
        assert batch.uncond_velocities.shape == (4, stop - start, *batch.latents.shape[2:])
        with torch.no_grad():
            j = torch.arange(start, stop)
            latents = fresh.to_device(batch.latents[1, j]).to(fresh.dtype)
            cond = batch.cond.apply(lambda t: fresh.to_device(t[[1] * len(j)]))
            again = fresh.family.velocity_pass(fresh.actor, latents, batch.sigmas[j], cond, negative=True)
        assert (again - batch.uncond_velocities[1]).abs().max() < 1e-5
        advantages = torch.tensor([1.0, -1.0, 0.5, -0.5])
        reused = gradients_of_stepping_update(fresh, flow_grpo.GRPOBatch(batch, advantages))
        recomputed = gradients_of_stepping_update(
            fresh, flow_grpo.GRPOBatch(replace(batch, uncond_velocities=None), advantages)
        )
    finally:
        fresh.cfg.algorithm.cfg_gradient, fresh.engine.keep_uncond = "both", False
    assert len(reused) == len(recomputed) == 2
    for a, b in zip(reused, recomputed):
        assert torch.allclose(a, b, rtol=1e-4, atol=1e-6), float((a - b).abs().max())
