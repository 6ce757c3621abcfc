"""The reward-hacking sentinel (omni/sentinel.py): its statistics on constructed images, its
rules on constructed figures, and real training runs on the tiny SD3 in which the brightness
reward is hacked or is not.

The hackable run: brightness is trained (full fine-tuning at a large step, so the images
brighten within a few steps) and evaluated on prompts naming dark colours, with the colour
reward as gold: the brighter the images, the further they are from the colour the prompt
names. The healthy run is the same training evaluated on prompts naming light colours, where
brighter images are truer to the prompt and the gold reward rises with the training reward.
"""

import logging
import math
import re

import pytest
import torch

from omni import checkpoint
from omni.config.sentinel import SentinelConfig, Statistic
from omni.sentinel import (
    Evaluation,
    Sentinel,
    brightness,
    color_entropy,
    dark_fraction,
    edge_density,
    gold_findings,
    image_statistics,
    latent_norm,
    paired_change,
    saturation,
    statistic_findings,
)
from omni.trainer import SentinelStopped, run
from omni.validation import ConfigError, validate
from tests.conftest import compose_config

DARK = ["a red cat", "a blue bird", "a black house", "a purple circle", "a green car"] * 2
LIGHT = ["a white dog", "a yellow square", "a pink flower", "a white tree", "a yellow flower"] * 2
# the hackable task: brightness trained fast (6 steps of full fine-tuning at lr 3e-3 brighten
# the held-out images by ~0.02, paired t ~12; the tiny LoRA needs ~50 steps for half of that)
FAST = [
    "model.lora=null",
    "trainer.lr=3e-3",
    "trainer.batch_size=8",
    "algorithm.group_size=4",
    "eval.images_per_prompt=2",
    "trainer.progress_bar=false",
    "sentinel.enabled=true",
    "+sentinel.gold.color={}",
]


# ----------------------------------------------------------------- statistics
def test_statistics_of_constructed_images():
    black, white = torch.zeros(1, 3, 8, 8), torch.ones(1, 3, 8, 8)
    red = torch.zeros(1, 3, 8, 8)
    red[:, 0] = 1
    assert brightness(black).item() == 0 and brightness(white).item() == pytest.approx(1)
    assert brightness(red).item() == pytest.approx(0.299)
    assert saturation(white).item() == 0 and saturation(black).item() == 0 and saturation(red).item() == 1
    assert dark_fraction(black).item() == 1 and dark_fraction(white).item() == 0
    assert color_entropy(red).item() == 0
    halves = torch.cat([black[..., :4], white[..., 4:]], dim=-1)  # two colours, half each: 1 bit
    assert color_entropy(halves).item() == pytest.approx(1)
    assert color_entropy(torch.rand(1, 3, 64, 64)).item() > 5  # close to log2(64) = 6
    assert edge_density(white).item() == 0
    checker = (torch.arange(8)[:, None] + torch.arange(8)[None, :]) % 4 < 2
    assert edge_density(checker.float().expand(1, 3, 8, 8)).item() > 0.9
    assert latent_norm(torch.full((2, 4, 3, 3), 2.0)).tolist() == [2.0, 2.0]


def test_image_statistics_has_every_statistic_and_averages_a_clips_frames():
    images = torch.rand(3, 3, 16, 16)
    stats = image_statistics(images, torch.randn(3, 4, 2, 2))
    assert set(stats) == {s.value for s in Statistic} and all(v.shape == (3,) for v in stats.values())
    clips = torch.stack([torch.zeros(3, 16, 16), torch.ones(3, 16, 16)]).unsqueeze(0)  # (1, 2 frames, 3, H, W)
    assert image_statistics(clips, torch.zeros(1, 8))["brightness"].item() == pytest.approx(0.5)


# ----------------------------------------------------------------- rules
def evaluation(step, reward, gold, brightness_values):
    return Evaluation(
        step, torch.tensor(reward), {"color": torch.tensor(gold)}, {"brightness": torch.tensor(brightness_values)}
    )


def test_paired_change_and_its_standard_error_over_images_finite_in_both():
    change, se, n = paired_change(torch.tensor([1.0, 2.0, math.nan, 4.0]), torch.tensor([2.0, 2.0, 9.0, 6.0]))
    assert (change, n) == (1.0, 3) and se == pytest.approx(1 / math.sqrt(3))


def test_gold_rule_fires_when_reward_rises_and_gold_falls_by_more_than_k_se():
    base = evaluation(0, [0.5, 0.5, 0.5, 0.5], [0.6, 0.6, 0.6, 0.6], [0.5] * 4)
    hacked = evaluation(7, [0.6, 0.6, 0.6, 0.6], [0.5, 0.51, 0.49, 0.5], [0.6] * 4)
    (finding,) = gold_findings(base, hacked, k=3)
    assert (finding.rule, finding.name, finding.step) == ("gold", "color", 7)
    assert re.search(
        r"'gold' fired at step 7: the training reward rose by \+0\.1 .*'color' fell by -0\.1 ", finding.message
    )
    assert "sentinel.gold_drop_se=3" in finding.message and "standard errors" in finding.message
    # the gold's fall within the noise, a reward that did not rise, a gold that rose: no finding
    noisy = evaluation(7, [0.6] * 4, [0.4, 0.8, 0.45, 0.7], [0.6] * 4)
    assert gold_findings(base, noisy, k=3) == []
    assert gold_findings(base, evaluation(7, [0.5] * 4, [0.5] * 4, [0.6] * 4), k=3) == []
    assert gold_findings(base, evaluation(7, [0.6] * 4, [0.7, 0.71, 0.69, 0.7], [0.6] * 4), k=3) == []


def test_statistic_rule_fires_when_a_watched_statistic_leaves_k_base_sd():
    base = evaluation(0, [0.5] * 4, [0.6] * 4, [0.4, 0.5, 0.6, 0.5])  # sd 0.0816
    moved = evaluation(3, [0.5] * 4, [0.6] * 4, [0.7, 0.8, 0.9, 0.8])  # +0.3: 3.7 sd
    (finding,) = statistic_findings(base, moved, k=2, watch=[Statistic.brightness])
    assert finding.rule == "statistic" and finding.step == 3
    assert "brightness moved by +0.3 (0.5 -> 0.8), 3.67 standard deviations" in finding.message
    assert statistic_findings(base, moved, k=4, watch=[Statistic.brightness]) == []
    assert statistic_findings(base, moved, k=2, watch=[]) == []


def test_sentinel_takes_the_first_evaluation_as_base_and_records_where_rules_held():
    sentinel = Sentinel(SentinelConfig(enabled=True, gold_drop_se=3))
    base = evaluation(0, [0.5] * 4, [0.6] * 4, [0.5] * 4)
    assert sentinel.judge(base) == [] and sentinel.base is base
    assert sentinel.judge(evaluation(1, [0.55] * 4, [0.6, 0.61, 0.59, 0.6], [0.5] * 4)) == []
    assert len(sentinel.judge(evaluation(2, [0.6] * 4, [0.5, 0.51, 0.49, 0.5], [0.5] * 4))) == 1
    assert sentinel.held == [0, 1]
    metrics = sentinel.metrics(evaluation(2, [0.6] * 4, [0.5, 0.51, 0.49, 0.5], [0.5] * 4), ["found"])
    assert metrics["sentinel/fired"] == 1 and metrics["sentinel/gold/color/change"] == pytest.approx(-0.1)
    assert metrics["sentinel/reward_change"] == pytest.approx(0.1) and "sentinel/brightness/shift_sd" in metrics
    restored = Sentinel(sentinel.cfg)
    restored.load_state_dict(sentinel.state_dict())
    assert restored.held == [0, 1] and torch.equal(restored.base.gold["color"], base.gold["color"])


# ----------------------------------------------------------------- validation
@pytest.mark.parametrize(
    "overrides, message",
    [
        (["sentinel.enabled=true"], "sentinel.enabled=true but no rule can fire"),
        (["sentinel.enabled=true", "+sentinel.gold.colour={}"], "sentinel.gold.colour: no such reward"),
        (["sentinel.enabled=true", "+sentinel.gold.color={weigth:1}"], "sentinel.gold.color: Key 'weigth'"),
        (
            ["sentinel.enabled=true", "+sentinel.gold.color={}", "sentinel.action=rollback", "eval.every=2"],
            "sentinel.action=rollback with eval.every=2 and trainer.save_every=0",
        ),
        (["sentinel.stat_shift_sd=0"], "sentinel.stat_shift_sd=0"),
        (["sentinel.lr_factor=2"], "sentinel.lr_factor=2"),
    ],
)
def test_bad_sentinel_config_fails_at_validation_naming_the_key(overrides, message):
    with pytest.raises(ConfigError, match=re.escape(message)):
        validate(compose_config(overrides))


def test_gold_rewards_are_typed_at_validation():
    cfg = validate(compose_config(["sentinel.enabled=true", "+sentinel.gold.color={}"]))
    assert type(cfg.sentinel.gold["color"]).__name__ == "RewardOptions"


# ----------------------------------------------------------------- training runs
def config(tiny_cache, tmp_path, prompts, *overrides):
    eval_file = tmp_path / "eval_prompts.txt"
    eval_file.write_text("\n".join(prompts) + "\n")
    return compose_config(
        [f"model.cache_dir={tiny_cache}", f"data.eval={eval_file}", *FAST, *overrides], tmp_path / "run"
    )


def logged(caplog, key):
    """(step, value) of each logged `key`, in order."""
    found = []
    for record in caplog.records:
        match = re.match(r"step (\d+): (.*)", record.getMessage())
        if match:
            values = dict(item.split("=") for item in match.group(2).split())
            if key in values:
                found.append((int(match.group(1)), float(values[key])))
    return found


def test_hackable_run_is_stopped_naming_the_rule_the_step_and_the_figures(tiny_cache, tmp_path, caplog):
    cfg = config(
        tiny_cache, tmp_path, DARK, "trainer.steps=6", "eval.every=2", "sentinel.gold_drop_se=2.5",
        "sentinel.action=stop",
    )  # fmt: skip
    with caplog.at_level(logging.INFO), pytest.raises(SentinelStopped) as stopped:
        run(cfg)
    message = str(stopped.value)
    assert re.search(
        r"sentinel rule 'gold' fired at step 2: the training reward rose by \+0\.00\d+ \(0\.51\d+ -> 0\.52\d+\) "
        r"while gold reward 'color' fell by -0\.00\d+ .*standard errors \(se .* over 20 images; "
        r"sentinel.gold_drop_se=2.5\)",
        message,
    ), message
    assert "sentinel.action=stop" in message and "Training stopped: no checkpoint was saved yet" in message
    assert checkpoint.latest_checkpoint(tmp_path / "run" / "checkpoints") is None


def test_healthy_run_trains_to_the_end_and_logs_the_sentinel(tiny_cache, tmp_path, caplog):
    cfg = config(tiny_cache, tmp_path, LIGHT, "trainer.steps=6", "eval.every=2", "sentinel.action=stop")
    with caplog.at_level(logging.INFO):
        run(cfg)
    assert not [r for r in caplog.records if "sentinel rule" in r.getMessage()]
    assert checkpoint.latest_checkpoint(tmp_path / "run" / "checkpoints").name == "step_000006"
    (last_change,) = [value for step, value in logged(caplog, "sentinel/gold/color/change_se") if step == 6]
    (reward_change,) = [value for step, value in logged(caplog, "sentinel/reward_change") if step == 6]
    assert reward_change > 0.01 and last_change > 0  # the reward and the gold rose together
    for key in ("brightness", "saturation", "color_entropy", "dark_fraction", "edge_density", "latent_norm"):
        assert [step for step, _ in logged(caplog, f"sentinel/{key}")] == [0, 6], key


def test_statistic_rule_warns_and_training_goes_on(tiny_cache, tmp_path, caplog):
    cfg = config(
        tiny_cache, tmp_path, DARK, "trainer.steps=6", "sentinel.gold_drop_se=null", "sentinel.stat_shift_sd=1.2",
        "sentinel.watch=[brightness,saturation]",
    )  # fmt: skip
    with caplog.at_level(logging.INFO):
        run(cfg)
    (warning,) = [r.getMessage() for r in caplog.records if "sentinel rule" in r.getMessage()]
    assert re.search(
        r"'statistic' fired at step 6: brightness moved by \+0\.01\d+ .* 1\.\d+ standard deviations", warning
    )
    assert "saturation" not in warning and "sentinel.action=warn: training goes on" in warning
    assert checkpoint.latest_checkpoint(tmp_path / "run" / "checkpoints").name == "step_000006"


def test_rollback_reloads_the_last_checkpoint_where_rules_held_with_a_lower_lr(tiny_cache, tmp_path, caplog):
    """Pinned on the tiny SD3 (each figure at least 0.7 se from the threshold, 4): the gold rule
    holds at step 2 (-3.3 se) and fires at step 4 (-5.5 se); the run goes back to step 2 with
    the learning rate scaled by 0.01, so the images hardly move from step 2's, and the rule
    holds at steps 4 and 6."""
    cfg = config(
        tiny_cache, tmp_path, DARK, "trainer.steps=6", "eval.every=2", "trainer.save_every=2",
        "sentinel.gold_drop_se=4", "sentinel.action=rollback", "sentinel.lr_factor=0.01", "logger.console_every=1",
    )  # fmt: skip
    with caplog.at_level(logging.INFO):
        run(cfg)
    (rolled,) = [r.getMessage() for r in caplog.records if "rolled back" in r.getMessage()]
    assert re.search(
        r"'gold' fired at step 4: .* rolled back to \S+step_000002 \(the rules held at step 2\), "
        r"learning rate scaled by 0.01 \(sentinel.lr_factor=0.01; rollback 1 of at most 2\)",
        rolled,
    ), rolled
    lrs = logged(caplog, "train/lr")
    assert [step for step, _ in lrs] == [1, 2, 3, 4, 3, 4, 5, 6]
    assert [lr for _, lr in lrs] == pytest.approx([3e-3] * 4 + [3e-5] * 4)
    assert logged(caplog, "sentinel/fired") == [(0, 0), (2, 0), (4, 1), (4, 0), (6, 0)]
    assert logged(caplog, "sentinel/rollbacks")[-1] == (6, 1)
    saved = [p.name for p in checkpoint.checkpoint_dirs(tmp_path / "run" / "checkpoints")]
    assert saved == ["step_000006", "step_000004", "step_000002"]  # step 4 saved once the rule held there


def test_resumed_run_keeps_the_base_evaluation_of_the_run_it_continues(tiny_cache, tmp_path, caplog):
    run(config(tiny_cache, tmp_path, LIGHT, "trainer.steps=2"))
    with caplog.at_level(logging.INFO):
        run(config(tiny_cache, tmp_path, LIGHT, "trainer.steps=3", "trainer.resume=auto"))
    (resumed, final) = logged(caplog, "sentinel/reward_change")
    assert resumed[0] == 2 and resumed[1] > 0.003 and final[0] == 3  # measured against step 0's evaluation
