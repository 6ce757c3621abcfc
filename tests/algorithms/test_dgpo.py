"""DGPO's group preference loss on hand-computed numbers, its noise and batch sharding, and
its update and training step on the tiny SD3."""

import math
from types import SimpleNamespace

import pytest
import torch

from omni.algorithms import dgpo
from omni.algorithms.dpo import diffusion_dpo_loss


def test_loss_hand_computed():
    """One group of 3, beta 10: A = (1, 0, -1), e - e_ref = (-0.1, 0, 0.2), so the implicit
    rewards -10 (e - e_ref) are (1, 0, -2), the logit (1 x 1 + 0 + -1 x -2) / 3 = 1 and the loss
    -log sigmoid(1) = log(1 + e^-1)."""
    out = dgpo.dgpo_loss(
        torch.tensor([0.1, 0.5, 0.3]), torch.tensor([0.2, 0.5, 0.1]), torch.tensor([1.0, 0.0, -1.0]), 3, beta=10.0
    )
    assert math.isclose(out["loss"].item(), math.log(1 + math.exp(-1)), rel_tol=1e-6)
    assert math.isclose(out["reward_margin"].item(), 1.0, rel_tol=1e-6) and out["implicit_accuracy"] == 1


def test_a_pair_is_diffusion_dpo():
    """A group of two with advantages (1, -1) is Diffusion-DPO's pair, at the same beta."""
    policy, ref = torch.tensor([0.31, 0.27]), torch.tensor([0.30, 0.25])
    out = dgpo.dgpo_loss(policy, ref, torch.tensor([1.0, -1.0]), 2, beta=40.0)
    pair = diffusion_dpo_loss(policy[:1], policy[1:], ref[:1], ref[1:], beta=40.0)
    assert math.isclose(out["loss"].item(), pair["loss"].item(), rel_tol=1e-6)


def test_gradient_lowers_the_error_of_the_better_images():
    """At the reference (every logit 0, loss log 2), d loss / d e_i = beta A_i / (2 G): the
    policy lowers its error on the images with A > 0 and raises it on those with A < 0; the
    reference's errors get no gradient."""
    policy = torch.full((4,), 0.5, requires_grad=True)
    ref = torch.full((4,), 0.5, requires_grad=True)
    advantages = torch.tensor([1.5, -0.5, 0.0, -1.0])
    out = dgpo.dgpo_loss(policy, ref, advantages, 4, beta=8.0)
    out["loss"].backward()
    assert math.isclose(out["loss"].item(), math.log(2), rel_tol=1e-6)
    assert torch.allclose(policy.grad, 8.0 * advantages / 8)
    assert ref.grad is None or torch.equal(ref.grad, torch.zeros(4))


def test_each_group_is_its_own_preference():
    """Two groups: the mean of each group's -log sigmoid, not one sigmoid of all images."""
    policy, ref = torch.tensor([0.1, 0.3, 0.2, 0.9]), torch.tensor([0.2, 0.2, 0.5, 0.1])
    advantages = torch.tensor([1.0, -1.0, 1.0, -1.0])
    both = dgpo.dgpo_loss(policy, ref, advantages, 2, beta=5.0)["loss"]
    apart = [dgpo.dgpo_loss(policy[s], ref[s], advantages[s], 2, beta=5.0)["loss"] for s in (slice(0, 2), slice(2, 4))]
    assert math.isclose(both.item(), (apart[0] + apart[1]).item() / 2, rel_tol=1e-6)
    assert not math.isclose(both.item(), dgpo.dgpo_loss(policy, ref, advantages, 4, beta=5.0)["loss"].item())


def test_rows_must_make_whole_groups():
    with pytest.raises(ValueError, match="groups of 3"):
        dgpo.dgpo_loss(torch.zeros(4), torch.zeros(4), torch.zeros(4), 3, beta=1.0)


def test_trust_region_stops_the_gradient_where_the_ratio_left_its_range():
    """clip_range 0.1, rho = exp(e_old - e). A > 0: image 0's error fell 0.2 (rho 1.22, past
    1.1: clipped), image 1's 0.02 (1.02: kept), image 2's rose 0.2 (0.82, the wrong way: kept).
    A < 0: image 3's rose 0.2 (0.82, below 0.9: clipped), image 4's fell 0.2 (1.22, the wrong
    way: kept), image 5's rose 0.02 (kept). A clipped error keeps its value, not its gradient."""
    old = torch.full((6,), 0.5)
    policy = (old + torch.tensor([-0.2, -0.02, 0.2, 0.2, -0.2, 0.02])).requires_grad_()
    advantages = torch.tensor([1.0, 1.0, 1.0, -1.0, -1.0, -1.0])
    free = torch.autograd.grad(dgpo.dgpo_loss(policy, old, advantages, 6, beta=10.0)["loss"], policy)[0]
    errors, clipped = dgpo.clip_errors(policy, old, advantages, 0.1)
    assert clipped.tolist() == [True, False, False, True, False, False]
    assert torch.equal(errors, policy)
    dgpo.dgpo_loss(errors, old, advantages, 6, beta=10.0)["loss"].backward()
    assert torch.equal(policy.grad[clipped], torch.zeros(2)) and (free[clipped] != 0).all()
    assert torch.equal(policy.grad[~clipped], free[~clipped])


def test_kl_enters_with_weight_kl_coef_times_beta():
    """loss = the group loss + kl_coef x beta x mean kl: d loss / d kl_i = kl_coef beta / n."""
    policy, ref = torch.tensor([0.3, 0.2, 0.4, 0.1]), torch.tensor([0.25, 0.2, 0.3, 0.2])
    advantages = torch.tensor([1.0, -1.0, 0.5, -0.5])
    kl = torch.tensor([0.1, 0.0, 0.3, 0.2], requires_grad=True)
    without = dgpo.dgpo_loss(policy, ref, advantages, 2, beta=20.0)
    out = dgpo.dgpo_loss(policy, ref, advantages, 2, beta=20.0, kl=kl, kl_coef=0.05)
    out["loss"].backward()
    assert math.isclose(out["loss"].item(), without["loss"].item() + 0.05 * 20.0 * 0.15, rel_tol=1e-6)
    assert torch.allclose(kl.grad, torch.full((4,), 0.05 * 20.0 / 4))
    assert math.isclose(out["kl"].item(), 0.15, rel_tol=1e-6) and "kl" not in without


def test_noise_is_shared_within_a_group_and_does_not_depend_on_the_shard():
    """The noise of groups [2, 4) of a batch of 4 is the whole batch's rows for them, and each
    unit (group, level) is one noise the group's images share."""
    algo = dgpo.DGPOConfig(name="dgpo", timesteps_per_group=3)
    sigmas, noise = dgpo.group_noise(algo, 4, (2, 2), seed=5, first=0, n=4)
    part_sigmas, part_noise = dgpo.group_noise(algo, 4, (2, 2), seed=5, first=2, n=2)
    assert sigmas.shape == (12,) and noise.shape == (12, 2, 2)
    assert torch.equal(part_sigmas, sigmas[6:]) and torch.equal(part_noise, noise[6:])
    from omni.models.sd3 import PromptEmbeds

    cond = PromptEmbeds(torch.arange(8.0).reshape(8, 1, 1), torch.arange(8.0).reshape(8, 1))
    batch = dgpo.GroupBatch(torch.randn(8, 2, 2), cond, torch.arange(8.0), group_size=2)
    part = batch.select(slice(1, 3))  # groups 1 and 2: images 2 to 5
    assert len(batch) == 4 and len(part) == 2
    assert torch.equal(part.advantages, torch.tensor([2.0, 3.0, 4.0, 5.0])) and torch.equal(
        part.cond.pooled[:, 0], part.advantages
    )


class Device:
    """The worker's `to_device` alone."""

    @staticmethod
    def to_device(t):
        return t


def test_a_units_images_are_its_groups_noised_alike():
    from omni.models.sd3 import PromptEmbeds

    clean = torch.arange(6.0).reshape(6, 1)
    cond = PromptEmbeds(torch.arange(6.0).reshape(6, 1, 1), torch.arange(6.0).reshape(6, 1))
    batch = dgpo.GroupBatch(clean, cond, torch.tensor([1.0, 0.0, -1.0, 2.0, -1.0, -1.0]), group_size=3)
    units = dgpo.Units(batch, torch.tensor([0.1, 0.2, 0.3, 0.4]), torch.tensor([[1.0], [2.0], [3.0], [4.0]]), 2)
    noisy, sigmas, unit_cond, target, advantages = units.inputs(Device, torch.tensor([3, 0]))
    # unit 3: group 1 at its second level (sigma 0.4, noise 4); unit 0: group 0 at its first
    assert torch.allclose(sigmas, torch.tensor([0.4, 0.4, 0.4, 0.1, 0.1, 0.1]))
    assert torch.equal(advantages, torch.tensor([2.0, -1.0, -1.0, 1.0, 0.0, -1.0]))
    x0 = torch.tensor([3.0, 4.0, 5.0, 0.0, 1.0, 2.0])
    eps = torch.tensor([4.0, 4.0, 4.0, 1.0, 1.0, 1.0])
    assert torch.allclose(noisy[:, 0], (1 - sigmas) * x0 + sigmas * eps)
    assert torch.allclose(target[:, 0], eps - x0) and torch.equal(unit_cond.pooled[:, 0], x0)


class Linear(Device):
    """A worker whose velocity is w x the noisy latents: w = 1.5 for the policy, 1 for the reference."""

    def __init__(self, algorithm):
        self.cfg = SimpleNamespace(algorithm=algorithm)
        self.w = torch.tensor(1.5, requires_grad=True)

    def velocity(self, noisy, sigmas, cond, guidance_scale, reference=False):
        return noisy * (1.0 if reference else self.w)


def test_unit_loss_takes_the_kl_to_the_reference_and_clips_against_the_update_start():
    """The KL is between the policy's and the reference's velocities, |0.5 x_t|^2; at the
    update's start nothing clips, and with the start's errors 1 higher (rho = e > 1.1) exactly
    the images of positive advantage clip (2 of each group's 3)."""
    from omni.models.sd3 import PromptEmbeds

    cond = PromptEmbeds(torch.zeros(6, 1, 1), torch.zeros(6, 1))
    advantages = torch.tensor([1.0, 0.5, -1.5, 2.0, 1.0, -3.0])
    batch = dgpo.GroupBatch(torch.arange(6.0).reshape(6, 1), cond, advantages, group_size=3)
    data = dgpo.Units(batch, torch.tensor([0.1, 0.2, 0.3, 0.4]), torch.tensor([[1.0], [2.0], [3.0], [4.0]]), 2)
    worker = Linear(dgpo.DGPOConfig(name="dgpo", beta=10.0, clip_range=0.1, kl_coef=0.5))
    ref, old = dgpo.unit_errors(worker, data), dgpo.unit_errors(worker, data, reference=False)
    units = torch.tensor([3, 0])
    out = dgpo.unit_loss(worker, data, dgpo.Baselines(ref, old), units)
    noisy = data.inputs(worker, units)[0]
    assert math.isclose(out["kl"].item(), float((0.5 * noisy).pow(2).mean()), rel_tol=1e-6)
    assert out["clip_fraction"] == 0
    shifted = dgpo.unit_loss(worker, data, dgpo.Baselines(ref, old + 1), units)
    assert math.isclose(shifted["clip_fraction"].item(), 2 / 3, rel_tol=1e-6)


def test_update_prefers_the_better_image(fresh, monkeypatch):
    """On the tiny model, a group of two whose first image is the better one: after a few
    updates the policy's error on it, relative to the reference's, falls below the second's."""
    from tests.algorithms.test_flow_grpo_update import rollout

    monkeypatch.setattr(
        fresh.cfg, "algorithm", dgpo.DGPOConfig(name="dgpo", beta=50.0, timesteps_per_group=4, num_minibatches=1)
    )
    batch = rollout(fresh, n=2)
    group = dgpo.GroupBatch(batch.latents[:, -1], batch.cond, torch.tensor([1.0, -1.0]), group_size=2)

    def margin():
        sigmas, noise = dgpo.group_noise(fresh.cfg.algorithm, 1, group.clean.shape[1:], 11, 0, 1)
        data = dgpo.Units(group, sigmas, noise, 4)
        with torch.no_grad():
            noisy, s, cond, target, advantages = data.inputs(fresh, torch.arange(4))
            gap = dgpo.per_sample_mse(fresh.velocity(noisy, s, cond, 1.0), target) - dgpo.unit_errors(fresh, data)
        return float((gap.reshape(4, 2) * advantages.reshape(4, 2)).sum())  # sum of A (e - e_ref): < 0 is preferred

    assert margin() == 0  # the LoRA starts at the reference
    for seed in range(3):
        metrics = fresh.apply_update(dgpo.update, group, seed=seed)
    assert metrics["grad_norm"] > 0 and margin() < 0


def test_two_training_steps_change_the_lora(tiny_cache, tmp_path):
    """`algorithm=dgpo` through the trainer on the tiny SD3 (its model_algorithm preset): two
    steps of ODE rollouts and group preference updates, with the authors' trust region and
    KL (the defaults), run, log their metrics and move the LoRA."""
    from omni.trainer import Trainer
    from omni.validation import validate
    from tests.conftest import compose_config

    cfg = validate(
        compose_config(
            [f"model.cache_dir={tiny_cache}", "algorithm=dgpo", "trainer.steps=2", "trainer.batch_size=8",
             "algorithm.group_size=4", "algorithm.num_minibatches=1", "rollout.num_steps=4",
             "trainer.progress_bar=false", "reward=multi",
             "reward.aggregation=gdpo"],
            tmp_path,
        )
    )  # fmt: skip
    trainer = Trainer(cfg)
    trainer.setup()
    try:
        before = trainer.worker.lora_state_dict()
        metrics = [trainer.algorithm.step(step) for step in range(2)]
        after = trainer.worker.lora_state_dict()
    finally:
        trainer.cleanup()
    assert all(math.isfinite(m["train/loss"]) and m["train/grad_norm"] > 0 for m in metrics)
    assert math.isclose(metrics[0]["train/loss"], math.log(2), rel_tol=1e-4)  # step 1's one minibatch: at the reference
    assert metrics[0]["train/kl"] == 0 < metrics[1]["train/kl"]  # the KL to the reference, once the LoRA moved
    assert metrics[0]["train/clip_fraction"] == 0  # one minibatch: the policy is the update's start
    assert "reward/brightness/advantage_std" in metrics[0]
    assert any(not torch.equal(before[k], after[k]) for k in before)
