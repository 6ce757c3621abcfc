"""AWM's matching error, surrogate, penalties and noise levels on hand-computed numbers, its
update on the tiny SD3 (a good image's matching error goes down relative to a bad one's), and
a short run through the trainer that changes the LoRA and makes the EMA snapshot follow it."""

import math
from types import SimpleNamespace

import pytest
import torch

from omni.algorithms import awm
from omni.validation import validate
from tests.conftest import compose_config

ALGO = SimpleNamespace(weighting="uniform", ghuber_power=0.5, clip_range=0.2, kl_coef=0.5, ema_kl_coef=2.0)


def test_matching_error_hand_computed():
    """v = (1, 3), target eps - x0 = (1, 1): e = (0 + 4) / 2 = 2; ghuber (p = 0.5, t = 0.5):
    t (sqrt(2 + d) - sqrt(d)) / p = sqrt(2)."""
    v, target, t = torch.tensor([[1.0, 3.0]]), torch.ones(1, 2), torch.tensor([0.5])
    assert math.isclose(awm.matching_error(v, target, t).item(), 2.0, rel_tol=1e-6)
    assert math.isclose(awm.matching_error(v, target, t, "ghuber", 0.5).item(), math.sqrt(2), rel_tol=1e-4)


def test_surrogate_value_clip_and_gradient_hand_computed():
    """e = (0.5, 0.2), e_old = (0.4, 0.4), w = (1, -1), clip 0.2: rho = (e^-0.1, e^0.2) =
    (0.905, 1.221). Row 1 (w > 0, inside the clip): -rho; row 2 (w < 0): max(rho, 1.2) = rho.
    loss = (1.221 - 0.905) / 2; the second row is outside the clip range. d loss / d e =
    (w rho) / 2 = (0.452, -0.611): the good row's error is pushed down, the bad row's up."""
    error = torch.tensor([0.5, 0.2], requires_grad=True)
    loss, ratio, clip_fraction = awm.awm_policy_loss(error, torch.tensor([0.4, 0.4]), torch.tensor([1.0, -1.0]), 0.2)
    loss.backward()
    r1, r2 = math.exp(-0.1), math.exp(0.2)
    assert math.isclose(loss.item(), (r2 - r1) / 2, rel_tol=1e-6)
    assert clip_fraction.item() == 0.5
    assert torch.allclose(error.grad, torch.tensor([r1 / 2, -r2 / 2]))


def test_surrogate_gradient_at_the_rollout_policy_is_the_weighted_error_gradient():
    """At rho = 1 the surrogate's gradient in e is w / rows, whatever the clip range."""
    error = torch.tensor([0.3, 0.7, 0.1], requires_grad=True)
    weights = torch.tensor([1.0, -0.5, 0.25])
    loss, _, _ = awm.awm_policy_loss(error, error.detach(), weights, 1.0)
    loss.backward()
    assert math.isclose(loss.item(), -weights.mean().item(), rel_tol=1e-6)
    assert torch.allclose(error.grad, weights / 3)


def test_loss_adds_both_velocity_penalties():
    """v = (1, 1), target (1, 1): e = 0, rho = 1, w = 1: surrogate -1. |v - v_ref|^2 = (1 + 1) / 2
    = 1 (x 0.5), |v - v_ema|^2 = (0 + 4) / 2 = 2 (x 2): loss -1 + 0.5 + 4 = 3.5."""
    v = torch.ones(1, 2, requires_grad=True)
    loss, metrics = awm.awm_loss(
        v, torch.ones(1, 2), torch.tensor([0.5]), torch.zeros(1), torch.ones(1), ALGO,
        ref_velocity=torch.zeros(1, 2), ema_velocity=torch.tensor([[1.0, 3.0]]),
    )  # fmt: skip
    assert math.isclose(loss.item(), 3.5, rel_tol=1e-6)
    assert math.isclose(metrics["kl"].item(), 1.0) and math.isclose(metrics["kl_ema"].item(), 2.0)
    loss.backward()  # d/dv: surrogate 0 (e at its minimum), 0.5 (v - 0) + 2 (v - (1, 3)), per element
    assert torch.allclose(v.grad, torch.tensor([[0.5, 0.5 - 4.0]]))


def test_stratified_levels_fill_every_bin_of_the_schedule():
    """schedule: 10 steps, fraction 0.9: levels from steps 1 .. 8, one per stratum; continuous
    laws: one draw per bin of [0, 1) before the shift."""
    schedule = torch.linspace(1, 0, 11)
    algo = SimpleNamespace(timestep_sampling="schedule", timestep_fraction=0.9, timestep_shift=1.0)
    levels = awm.stratified_levels(500, 4, algo, schedule, torch.Generator().manual_seed(0))
    allowed = set(schedule[1:9].tolist())
    assert set(levels.flatten().tolist()) == allowed
    bins = (1 - levels) * 10  # step index 1 .. 8, two per stratum
    assert torch.all((bins[:, 0] < 2.5) & (bins[:, 3] > 6.5))
    algo.timestep_sampling = "uniform"
    u = awm.stratified_levels(500, 4, algo, schedule, torch.Generator().manual_seed(0))
    assert torch.all((u >= torch.arange(4) / 4) & (u < (torch.arange(4) + 1) / 4))
    algo.timestep_shift = 3.0
    assert torch.allclose(awm.stratified_levels(500, 4, algo, schedule, torch.Generator().manual_seed(0)),
                          awm.shift_levels(u, 3.0))  # fmt: skip
    algo.timestep_sampling = "logit_normal"
    t = awm.stratified_levels(20000, 1, algo, schedule, torch.Generator().manual_seed(0))
    assert abs(float(torch.logit(awm.shift_levels(t, 1 / 3)).std()) - 1) < 0.05  # sigmoid of N(0, 1), shifted


def test_ema_decay_ramps_to_its_ceiling():
    algo = SimpleNamespace(ema_kl_decay=0.3, ema_kl_decay_ramp=0.001)
    assert awm.ema_decay(algo, 1) == 0.001 and awm.ema_decay(algo, 1000) == 0.3
    algo.ema_kl_decay_ramp = 0
    assert awm.ema_decay(algo, 1) == 0.3
    average = {"a": torch.tensor([1.0])}
    awm.blend(average, {"a": torch.tensor([3.0])}, 0.25)
    assert average["a"].item() == 2.5


def test_update_lowers_a_good_images_matching_error_against_a_bad_ones(fresh, monkeypatch):
    """On the tiny model: after an update whose first image has weight +1 and second -1, the
    policy's matching error on the first falls relative to the second's."""
    from tests.algorithms.test_flow_grpo_update import rollout

    algo = awm.AWMConfig(name="awm", timesteps_per_sample=4, kl_coef=0.0, ema_kl_coef=0.0, num_minibatches=2)
    monkeypatch.setattr(fresh.cfg, "algorithm", algo)
    batch = rollout(fresh, n=2)
    data = awm.AWMBatch(batch.latents[:, -1], batch.cond, torch.tensor([1.0, -1.0]), 1.0, batch.sigmas)

    def errors():
        rows = awm.matching_rows(fresh, data, seed=7, first=0, total=2)
        return rows.old_error.reshape(2, 4).mean(1)

    # the target is the flow's velocity: x_t - t (eps - x0) is the clean latent again
    rows = awm.matching_rows(fresh, data, seed=7, first=0, total=2)
    t = rows.sigmas.reshape(-1, 1, 1, 1)
    assert torch.allclose(rows.noisy - t * rows.target, data.clean.repeat_interleave(4, 0), atol=1e-5)
    before = errors()
    metrics = fresh.apply_update(awm.update, data, seed=0)
    after = errors()
    assert metrics["grad_norm"] > 0 and metrics["kl"] == 0
    assert (after[0] - before[0]) < (after[1] - before[1]), (before, after)


BAD = {
    "timestep_fraction": (["algorithm.timestep_fraction=1.5"], "algorithm.timestep_fraction"),
    "schedule too short": (["algorithm.timestep_fraction=0.1"], "algorithm.timestep_fraction"),
    "kl_coef": (["algorithm.kl_coef=-1"], "algorithm.kl_coef"),
    "ema decay": (["algorithm.ema_kl_decay=1.0"], "algorithm.ema_kl_decay"),
    "ghuber power": (["algorithm.ghuber_power=0"], "algorithm.ghuber_power"),
    "clip range": (["algorithm.clip_range=0"], "algorithm.clip_range"),
    "shift": (["algorithm.timestep_shift=0"], "algorithm.timestep_shift"),
    "levels": (["algorithm.timesteps_per_sample=0"], "algorithm.timesteps_per_sample"),
    "cfg": (["rollout.guidance_scale=4.5"], "rollout.guidance_scale"),
    "ema without lora": (["model.lora=null"], "algorithm.ema_kl_coef"),
    "cps with the ode": (["rollout.sde_type=cps"], "algorithm.sampler=sde"),
    "unknown law": (["algorithm.timestep_sampling=beta"], "algorithm.timestep_sampling"),
}


@pytest.mark.parametrize("case", BAD)
def test_bad_options_fail_naming_the_key(case, tmp_path):
    overrides, key = BAD[case]
    with pytest.raises(Exception) as error:
        validate(compose_config(["algorithm=awm", *overrides], tmp_path))
    assert key in str(error.value) + str(error.value.__cause__ or ""), error.value


def test_two_steps_through_the_trainer_change_the_lora_and_the_ema(tiny_cache, tmp_path):
    from omni.trainer import Trainer

    overrides = [f"model.cache_dir={tiny_cache}", "algorithm=awm", "algorithm.sampler=sde", "trainer.batch_size=8",
                 "algorithm.group_size=4", "algorithm.timesteps_per_sample=2",
                 "trainer.progress_bar=false"]  # fmt: skip
    trainer = Trainer(validate(compose_config(overrides, tmp_path)))
    trainer.setup()
    try:
        initial = trainer.worker.lora_state_dict()
        for step in range(2):
            metrics = trainer.algorithm.step(step)
            assert math.isfinite(metrics["train/loss"]) and metrics["train/grad_norm"] > 0
        # the worker scores under the EMA the driver keeps: with one optimizer step per update it
        # is (1 - 0.001) the policy the second update starts from, so its distance is about 1e-6
        # of the reference's (a stale snapshot, still the base, would give kl_ema = kl)
        assert 0 < metrics["train/kl_ema"] < 0.01 * metrics["train/kl"], metrics
        trained = trainer.worker.lora_state_dict()
        ema = trainer.algorithm.state_dict()["ema"]
    finally:
        trainer.cleanup()
    assert any(not torch.equal(initial[n], trained[n]) for n in initial)
    # after two updates the EMA trails the policy: 0.002 of it is the previous update's
    assert any(not torch.equal(ema[n], trained[n]) for n in ema)
    assert all(torch.allclose(ema[n], trained[n], atol=1e-2) for n in ema)
