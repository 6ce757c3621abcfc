"""The evaluation (omni/evaluation.py): per-category means as computed by hand, the image cap
honoured on whole prompts, a warning when the prompts are the training ones, the sampler's
fields, and a real evaluation of the tiny SD3 (with its progress bar) whose held-out samples
reach tensorboard."""

import logging
import math

import pytest
import torch

from omni.data.prompts import Prompt
from omni.evaluation import EvalResult, before_after_table, category_means, load_eval_prompts, plan, sampling_options
from omni.trainer import Trainer
from omni.validation import validate
from tests.conftest import compose_config


def result(scores, tags):
    scores = {k: torch.tensor(v) for k, v in scores.items()}
    n = len(tags)
    return EvalResult(0, [f"p{i}" for i in range(n)], tags, list(range(n)), scores, None, category_means(scores, tags))


def test_per_category_means_match_hand_computed_values():
    evaluation = result(
        {"reward": [1.0, 0.0, 0.5, 0.25, float("nan")], "color": [0.0, 1.0, 1.0, 0.0, 1.0]},
        ["counting", "colors", "counting", "position", "colors"],
    )
    assert evaluation.categories == {
        "reward": {"counting": 0.75, "colors": 0.0, "position": 0.25},  # the NaN (dropped image) left out
        "color": {"counting": 0.5, "colors": 1.0, "position": 0.0},
    }
    metrics = evaluation.metrics()
    assert metrics["eval/reward"] == pytest.approx((1.0 + 0.0 + 0.5 + 0.25) / 4)
    assert metrics["eval/color"] == pytest.approx(3 / 5)
    assert metrics["eval/reward/counting"] == 0.75 and metrics["eval/color/colors"] == 1.0
    table = evaluation.table().splitlines()
    assert table[0].split() == ["category", "reward", "color", "images"]
    assert table[1].split() == ["counting", "0.7500", "0.5000", "2"]
    assert table[-1].split() == ["all", "0.4375", "0.6000", "5"]
    assert evaluation.summary()["per_image"][4]["reward"] is None


def test_the_closing_table_shows_the_reward_and_accuracy_before_and_after_per_category():
    tags = ["counting", "colors", "counting", "colors"]
    before = result(
        {"reward": [0.5, 0.0, 0.5, 1.0], "geneval/accuracy": [0.0, 0.0, 1.0, 1.0], "other": [1.0, 1.0, 1.0, 1.0]}, tags
    )
    after = result(
        {"reward": [1.0, 0.5, 0.5, 1.0], "geneval/accuracy": [1.0, 0.0, 1.0, 1.0], "other": [0.0, 0.0, 0.0, 0.0]}, tags
    )
    lines = before_after_table(before, after).splitlines()
    assert lines[0].split() == ["category", "reward", "geneval/accuracy"]  # no column for other scores
    assert lines[1].split() == [
        "counting",
        "0.5000",
        "->",
        "0.7500",
        "(+0.2500)",
        "0.5000",
        "->",
        "1.0000",
        "(+0.5000)",
    ]
    assert lines[2].split() == ["colors", "0.5000", "->", "0.7500", "(+0.2500)", "0.5000", "->", "0.5000", "(+0.0000)"]
    assert lines[3].split() == ["all", "0.5000", "->", "0.7500", "(+0.2500)", "0.5000", "->", "0.7500", "(+0.2500)"]


def test_prompts_without_a_category_have_overall_means_only():
    evaluation = result({"reward": [1.0, 3.0]}, [None, None])
    assert evaluation.categories == {} and evaluation.metrics() == {"eval/reward": 2.0}


def test_the_cap_keeps_the_first_whole_prompts_and_says_so(caplog):
    prompts = [Prompt(f"prompt {i}") for i in range(10)]
    cfg = compose_config(["eval.images_per_prompt=3", "eval.max_images=8"]).eval
    with caplog.at_level(logging.INFO, logger="omni.evaluation"):
        images, seeds = plan(cfg, prompts)
    assert images == [p for p in prompts[:2] for _ in range(3)]  # 2 whole prompts fit in 8 images
    assert len(seeds) == 6 and len(set(seeds)) == 6
    assert "the first 2 of 10 prompts x 3 images (eval.max_images=8" in caplog.text
    assert plan(cfg, prompts) == (images, seeds)  # the same at every evaluation
    uncapped, _ = plan(compose_config(["eval.images_per_prompt=3", "eval.max_images=null"]).eval, prompts)
    assert len(uncapped) == 30


def test_the_training_prompts_are_evaluated_only_with_a_warning(tmp_path, caplog):
    cfg = validate(compose_config(["data.eval=null"], tmp_path))
    with caplog.at_level(logging.WARNING, logger="omni.evaluation"):
        prompts = load_eval_prompts(cfg)
    assert len(prompts) == len(load_eval_prompts(validate(compose_config(["data.eval=omni:colors_train"]))))
    assert "evaluating on the training prompts" in caplog.text and "not held out" in caplog.text
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="omni.evaluation"):
        load_eval_prompts(validate(compose_config([], tmp_path)))  # data=colors has held-out prompts
    assert caplog.text == ""


def test_the_sampler_is_the_rollouts_unless_the_eval_group_says_otherwise(tmp_path):
    options = sampling_options(validate(compose_config(["rollout.num_steps=6"], tmp_path)))
    assert (options.num_steps, options.sde_steps) == (6, (0, 0))  # the rollout's steps, ODE
    cfg = validate(compose_config(["eval.steps=8", "eval.sde=true", "eval.guidance_scale=2.5"], tmp_path))
    options = sampling_options(cfg)
    assert (options.num_steps, options.sde_steps, options.guidance_scale) == (8, (0, 8), 2.5)


def test_an_evaluation_of_the_tiny_model_logs_its_samples_at_its_step(tiny_cache, tmp_path, capfd):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    # micro_batch_size=1: batches of 4 images, so the 6 images take 2 and the progress bar shows.
    overrides = [f"model.cache_dir={tiny_cache}", "eval=scenes", "eval.max_images=6", "eval.log_images=3",
                 "rollout.num_steps=4", "eval.steps=4", "logger=tensorboard", "rollout.micro_batch_size=1"]  # fmt: skip
    trainer = Trainer(validate(compose_config(overrides, tmp_path)))
    try:
        trainer.setup()
        evaluation, metrics, found = trainer.evaluate_and_watch(7)
    finally:
        trainer.cleanup()
    assert len(evaluation.prompts) == 6 and found == []
    bar = capfd.readouterr().err
    assert "eval step 7" in bar and "/6 " in bar  # its total (the last update may fall inside tqdm's refresh interval)
    assert evaluation.tags == ["single_object", "two_object", "counting", "colors", "position", "color_attr"]
    assert set(evaluation.scores) == {"reward", "brightness", "scene_geneval", "scene_geneval/accuracy",
                                      "scene_geneval/partial"}  # fmt: skip
    for tag in evaluation.tags:
        assert metrics[f"eval/scene_geneval/{tag}"] == float(
            evaluation.scores["scene_geneval"][evaluation.tags.index(tag)]
        )
    assert math.isfinite(metrics["eval/reward"])
    events = EventAccumulator(str(tmp_path / "tensorboard"), size_guidance={"images": 0, "tensors": 0})
    events.Reload()
    assert sorted(events.Tags()["images"]) == ["eval/images/0", "eval/images/1", "eval/images/2"]
    assert [e.step for e in events.Images("eval/images/0")] == [7]
    caption = events.Tensors("eval/images/text_summary")[0]
    assert caption.step == 7
    text = caption.tensor_proto.string_val[0].decode()
    assert evaluation.prompts[2] in text and "scene_geneval=" in text
