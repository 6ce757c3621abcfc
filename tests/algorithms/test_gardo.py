"""GARDO's gate, diversity bonus and features on hand-made tensors, the gated KL in the update on
the tiny SD3, its options' range checks, and short runs through the trainer: steps run and
change the LoRA, and a reset makes the reference the policy (the KL right after it is 0)."""

import math

import pytest
import torch

from omni.algorithms import flow_grpo, gardo
from omni.validation import validate
from tests.algorithms.test_flow_grpo_update import gradients_of_one_update, randomise_lora, rollout
from tests.conftest import compose_config

ALL = torch.ones(3, dtype=torch.bool)


def test_win_rates_hand_computed():
    """Scores (3, 1, 2): 3 beats both others, 1 none, 2 one of two; an invalid sample neither
    counts nor is counted."""
    assert torch.allclose(gardo.win_rates(torch.tensor([3.0, 1.0, 2.0]), ALL), torch.tensor([1.0, 0.0, 0.5]))
    assert torch.allclose(gardo.win_rates(torch.tensor([2.0, 2.0, 1.0]), ALL), torch.tensor([0.75, 0.75, 0.0]))
    valid = torch.tensor([True, True, False])
    assert torch.allclose(gardo.win_rates(torch.tensor([3.0, 1.0, 2.0]), valid), torch.tensor([1.0, 0.0, 0.0]))


def test_disagreement_is_positive_where_the_proxy_likes_a_sample_more():
    """The proxy ranks sample 0 first, the auxiliary last: u = 1 - 0; sample 1 the reverse."""
    u = gardo.disagreement(torch.tensor([3.0, 1.0, 2.0]), [torch.tensor([1.0, 3.0, 2.0])], ALL)
    assert torch.allclose(u, torch.tensor([1.0, -1.0, 0.0]))


def test_gate_weights_hand_computed():
    """Half of 4 valid samples: the two of largest signal, each weighted 4 / 2, so that a mean
    over the batch is the mean over them; fraction 1 is every sample at weight 1, 0 none."""
    signal, valid = torch.tensor([0.3, -1.0, 2.0, 0.5]), torch.ones(4, dtype=torch.bool)
    assert torch.equal(gardo.gate_weights(signal, valid, 0.5), torch.tensor([0.0, 0.0, 2.0, 2.0]))
    assert torch.equal(gardo.gate_weights(signal, valid, 0.1), torch.tensor([0.0, 0.0, 4.0, 0.0]))
    assert torch.equal(gardo.gate_weights(signal, valid, 1.0), torch.ones(4))
    assert torch.equal(gardo.gate_weights(signal, valid, 0.0), torch.zeros(4))
    valid[2] = False  # an invalid sample is never gated
    assert torch.equal(gardo.gate_weights(signal, valid, 0.3), torch.tensor([0.0, 0.0, 0.0, 4.0]))


def test_adaptive_fraction_follows_the_uncertainty_trend():
    """Window 3, rate 0.1: the first mean only starts the history; 0.5 beats every past mean
    (x 1.1), 0.45 lies between them (unchanged, though above their mean), 0.6 beats them
    (x 1.1), 0.35 falls below the last three (x 0.9; the first mean, 0.3, has left the window)."""
    gate = gardo.AdaptiveGate(0.1, 0.1, (0.02, 0.2), 3)
    fractions = []
    for level in (0.3, 0.5, 0.45, 0.6, 0.35):
        gate.update(level)
        fractions.append(gate.fraction)
    assert fractions == pytest.approx([0.1, 0.11, 0.11, 0.121, 0.1089])
    assert gate.history == [0.45, 0.6, 0.35]
    high, low = gardo.AdaptiveGate(0.19, 0.1, (0.02, 0.2), 3), gardo.AdaptiveGate(0.021, 0.1, (0.02, 0.2), 3)
    for level in (0.1, 0.2):
        high.update(level)
        low.update(0.3 - level)
    assert high.fraction == 0.2 and low.fraction == 0.02  # 0.209 and 0.0189, within the bounds


def test_adaptive_gate_gates_only_non_negative_uncertainty():
    """u = (-0.5, 0.2, 0.6, -0.1, 0, 0.4): 4 samples have u >= 0 (mean 0.3); half of them, the
    two largest, are gated at weight 6 / 2; the whole fraction gates all 4, never a negative u;
    a batch with no u >= 0 gates none and leaves the schedule alone."""
    signal, valid = torch.tensor([-0.5, 0.2, 0.6, -0.1, 0.0, 0.4]), torch.ones(6, dtype=torch.bool)
    half = gardo.AdaptiveGate(0.5, 0.1, (0.0, 1.0), 20)
    assert torch.equal(half.weights(signal, valid), torch.tensor([0.0, 0, 3, 0, 0, 3]))
    assert half.history == [pytest.approx(0.3)] and half.fraction == 0.5
    whole = gardo.AdaptiveGate(1.0, 0.1, (0.0, 1.0), 20)
    assert torch.equal(whole.weights(signal, valid), torch.tensor([0.0, 1.5, 1.5, 0, 1.5, 1.5]))
    valid[2] = False  # an invalid sample is never gated: 3 eligible, ceil(1.5) = 2 gated
    assert torch.equal(half.weights(signal, valid), torch.tensor([0.0, 3, 0, 0, 0, 3]))
    assert torch.equal(half.weights(-signal.abs() - 1, valid), torch.zeros(6)) and len(half.history) == 2


def test_features_hand_computed():
    image = torch.zeros(1, 3, 16, 16)
    image[..., :8] = 1.0  # left half white
    pixels = gardo.image_features(image, "pixels").reshape(3, 8, 8)
    assert torch.equal(pixels[:, :, :4], torch.ones(3, 8, 4)) and torch.equal(pixels[:, :, 4:], torch.zeros(3, 8, 4))
    histogram = gardo.image_features(image, "histogram").reshape(3, 8)
    expected = torch.zeros(3, 8)
    expected[:, 0] = expected[:, 7] = 0.5
    assert torch.equal(histogram, expected)
    clip = torch.rand(2, 3, 3, 16, 16)  # a video's frames are concatenated
    assert gardo.image_features(clip, "pixels").shape == (2, 3 * 3 * 64)


def test_nearest_distances_hand_computed():
    """A group of 3 on a line at 0, 1, 3: nearest neighbours 1, 1, 2; without sample 1: 3, 0, 3."""
    features = torch.tensor([[0.0], [1.0], [3.0]])
    assert torch.equal(gardo.nearest_distances(features, 3, ALL), torch.tensor([1.0, 1.0, 2.0]))
    valid = torch.tensor([True, False, True])
    assert torch.equal(gardo.nearest_distances(features, 3, valid), torch.tensor([3.0, 0.0, 3.0]))


def test_diversity_bonus_scales_positive_advantages_by_relative_distance():
    """d = (1, 1, 2), mean 4/3: A = (1, -1, 0.5) -> (1 x 3/4, -1 unchanged, 0.5 x 3/2)."""
    bonus = gardo.diversity_bonus(torch.tensor([1.0, -1.0, 0.5]), torch.tensor([1.0, 1.0, 2.0]), 3, ALL)
    assert torch.allclose(bonus, torch.tensor([0.75, -1.0, 0.75]))
    same = gardo.diversity_bonus(torch.tensor([1.0, -1.0, 0.0]), torch.zeros(3), 3, ALL)
    assert torch.equal(same, torch.tensor([1.0, -1.0, 0.0]))  # identical images: no bonus, no NaN


def test_gated_kl_weights_the_penalty_per_sample(fresh):
    """Zero weights: the gradient of kl_coef = 0; weights 1: Flow-GRPO's KL; the KL on the first
    sample alone: neither."""
    randomise_lora(fresh)  # policy != reference, so the KL has a gradient
    batch = rollout(fresh)
    advantages = torch.tensor([1.0, -1.0, 0.5, -0.5])
    fresh.cfg.algorithm.kl_coef = 0.0
    without = gradients_of_one_update(fresh, flow_grpo.GRPOBatch(batch, advantages))
    fresh.cfg.algorithm.kl_coef = 0.5
    full = gradients_of_one_update(fresh, flow_grpo.GRPOBatch(batch, advantages))

    def gated(weights):
        return gradients_of_one_update(fresh, flow_grpo.GRPOBatch(batch, advantages, torch.tensor(weights)))

    for a, b in zip(gated([0.0, 0, 0, 0]), without):
        assert torch.allclose(a, b, atol=1e-9)
    for a, b in zip(gated([1.0, 1, 1, 1]), full):
        assert torch.allclose(a, b, atol=1e-9)
    for a, b, c in zip(gated([4.0, 0, 0, 0]), without, full):
        assert (a - b).norm() > 1e-3 * b.norm() and (a - c).norm() > 1e-3 * c.norm()


BAD = {
    "gate fraction above 1": (["algorithm.gate_fraction=1.5"], "algorithm.gate_fraction"),
    "gate fraction below 0": (["algorithm.gate_fraction=-0.1"], "algorithm.gate_fraction"),
    "negative reset period": (["algorithm.reset_every=-1"], "algorithm.reset_every"),
    "reset threshold": (["algorithm.reset_kl_threshold=0"], "algorithm.reset_kl_threshold"),
    "disagreement without auxiliaries": (["algorithm.gate_by=disagreement"], "algorithm.gate_rewards"),
    "auxiliary not scored": (
        ["algorithm.gate_by=disagreement", "algorithm.gate_rewards=[jpeg_compressibility]"],
        "algorithm.gate_rewards",
    ),
    "reset without a lora": (["model.lora=null"], "algorithm.reset_every"),
    "unknown feature": (["algorithm.diversity_feature=dino"], "algorithm.diversity_feature"),
    "unknown gate schedule": (["algorithm.gate_schedule=sometimes"], "algorithm.gate_schedule"),
    "gate range reversed": (["algorithm.gate_fraction_range=[0.3,0.1]"], "algorithm.gate_fraction_range"),
    "gate range of one bound": (["algorithm.gate_fraction_range=[0.1]"], "algorithm.gate_fraction_range"),
    "gate range above 1": (["algorithm.gate_fraction_range=[0.1,1.5]"], "algorithm.gate_fraction_range"),
    "gate rate of 0": (["algorithm.gate_rate=0"], "algorithm.gate_rate"),
    "gate rate of 1": (["algorithm.gate_rate=1"], "algorithm.gate_rate"),
    "gate window of 0": (["algorithm.gate_window=0"], "algorithm.gate_window"),
}


@pytest.mark.parametrize("case", BAD)
def test_bad_options_fail_naming_the_key(case, tmp_path):
    overrides, key = BAD[case]
    with pytest.raises(Exception) as error:
        validate(compose_config(["algorithm=gardo", *overrides], tmp_path))
    assert key in str(error.value) + str(error.value.__cause__ or ""), error.value


def test_compatible_options_validate(tmp_path):
    validate(compose_config(["algorithm=gardo", "reward=multi", "reward.components.jpeg_compressibility.weight=0",
                             "algorithm.gate_by=disagreement", "algorithm.gate_rewards=[jpeg_compressibility]"],
                            tmp_path))  # fmt: skip
    validate(compose_config(["algorithm=gardo", "model.lora=null", "algorithm.reset_every=0"], tmp_path))
    adaptive = [
        "algorithm.gate_schedule=adaptive",
        "algorithm.gate_fraction_range=[0.05,0.5]",
        "algorithm.gate_window=5",
    ]
    validate(compose_config(["algorithm=gardo", *adaptive], tmp_path))


def run_two_steps(tiny_cache, tmp_path, *overrides, then=None):
    """Two steps of GARDO through the trainer (one minibatch, so each step's KL is measured
    before its only optimizer step), then `then(trainer)` -> (initial LoRA, final LoRA, each
    step's metrics)."""
    from omni.trainer import Trainer

    base = [f"model.cache_dir={tiny_cache}", "algorithm=gardo", "trainer.batch_size=8", "algorithm.group_size=4",
            "algorithm.num_minibatches=1", "algorithm.gate_fraction=1.0", "trainer.progress_bar=false"]  # fmt: skip
    trainer = Trainer(validate(compose_config([*base, *overrides], tmp_path)))
    trainer.setup()
    try:
        initial = trainer.worker.lora_state_dict()
        metrics = [trainer.algorithm.step(step) for step in range(2)]
        if then is not None:
            then(trainer)
        return initial, trainer.worker.lora_state_dict(), metrics
    finally:
        trainer.cleanup()


def test_two_steps_run_and_change_the_lora(tiny_cache, tmp_path):
    initial, trained, metrics = run_two_steps(tiny_cache, tmp_path, "reward=multi",
                                              "reward.components.jpeg_compressibility.weight=0",
                                              "algorithm.gate_by=disagreement", "algorithm.gate_fraction=0.25",
                                              "algorithm.gate_rewards=[jpeg_compressibility]")  # fmt: skip
    assert any(not torch.equal(initial[n], trained[n]) for n in initial)
    for m in metrics:
        assert math.isfinite(m["train/loss"]) and m["train/grad_norm"] > 0 and m["train/gated_fraction"] == 0.25
        assert m["train/diversity_shift"] > 0  # the bonus moved some advantage


def test_the_adaptive_gate_runs_and_is_checkpointed(tiny_cache, tmp_path):
    """`gate_schedule=adaptive` through the trainer: each step logs its fraction, within the
    bounds, the second moved from the first by the rate or not at all; the gate's state
    round-trips through the algorithm's state."""
    seen = {}

    def reload(trainer):
        state = trainer.algorithm.state_dict()
        trainer.algorithm.load_state_dict({}, 2)
        seen["fresh"] = (trainer.algorithm.gate.fraction, trainer.algorithm.gate.history)
        trainer.algorithm.load_state_dict(state, 2)
        seen["restored"], seen["saved"] = trainer.algorithm.gate.history, state["gate"]["history"]

    _, _, metrics = run_two_steps(tiny_cache, tmp_path, "algorithm.gate_schedule=adaptive",
                                  "algorithm.gate_fraction=0.1", then=reload)  # fmt: skip
    first, second = (m["train/gate_fraction"] for m in metrics)
    assert first == pytest.approx(0.1) and second in (pytest.approx(0.11), pytest.approx(0.1), pytest.approx(0.09))
    assert all(0 < m["train/gated_fraction"] <= 0.5 for m in metrics)  # at most the half with A >= 0, rounded up
    assert seen["fresh"] == (0.1, []) and seen["restored"] == seen["saved"] and len(seen["saved"]) == 2


def test_a_reset_makes_the_reference_the_policy(tiny_cache, tmp_path):
    """The first step starts at the base, so its KL is 0 either way. Without a reset the second
    step's KL is positive (the policy moved away from the base); with a reset before it, the
    reference is the policy the step starts from, and the KL is exactly 0."""
    _, _, kept = run_two_steps(tiny_cache, tmp_path / "kept", "algorithm.reset_every=0")
    _, _, reset = run_two_steps(tiny_cache, tmp_path / "reset", "algorithm.reset_every=1")
    assert kept[0]["train/kl"] == 0 and reset[0]["train/kl"] == 0
    assert kept[1]["train/kl"] > 0 and kept[1]["train/reference_reset"] == 0
    assert reset[1]["train/kl"] == 0 and reset[1]["train/reference_reset"] == 1


def test_a_checkpoint_restores_the_reset_reference(tiny_cache, tmp_path):
    """The algorithm's state keeps the reference LoRA: loading a state without one brings the
    reference back to the base (a larger KL), loading the saved one restores the KL exactly."""
    seen = {}

    def kl_now(trainer):
        batch = rollout(trainer.worker)
        start, stop = batch.options.sde_steps
        samples, steps = torch.arange(len(batch)).repeat_interleave(stop - start), torch.arange(start, stop).repeat(4)
        with torch.no_grad():
            return flow_grpo.score_transitions(trainer.worker, batch, samples, steps, True)[1].mean().item()

    def reload(trainer):
        state, algorithm = trainer.algorithm.state_dict(), trainer.algorithm
        assert state["last_reset"] == 1 and state["reference"] is not None
        seen["saved"] = kl_now(trainer)
        algorithm.load_state_dict({}, 2)  # a checkpoint from before any reset: the base
        seen["base"] = kl_now(trainer)
        algorithm.load_state_dict(state, 2)
        seen["restored"] = kl_now(trainer)

    run_two_steps(tiny_cache, tmp_path, "algorithm.reset_every=1", then=reload)
    assert seen["restored"] == seen["saved"] and seen["base"] > seen["saved"] > 0, seen
