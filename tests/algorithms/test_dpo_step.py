"""Diffusion-DPO through the real worker: log 2 at init, held-out implicit accuracy rises
after a few offline steps, best/worst pairing of online rollouts."""

import math

import pytest
import torch

from omni.algorithms import dpo
from omni.algorithms.base import ScoredRollout
from omni.algorithms.online_dpo import best_and_worst, ranking
from omni.data.pair_loader import split_positions
from omni.trainer import Trainer
from omni.validation import validate
from tests.conftest import compose_config


@pytest.fixture(params=["sd3_tiny", "flux_tiny", "qwen_image_tiny"])
def offline_trainer(request, tiny_cache, synthetic_pairs, tmp_path):
    """Offline DPO on each tiny family (FLUX and Qwen-Image: the pairs' images encoded to
    packed latents, Qwen-Image's by its 3-D VAE's encoder). A few decoder-inversion steps for
    the others: telling pairs apart needs no faithful latents."""
    encoding = [] if request.param == "qwen_image_tiny" else ["model.vae_inversion_steps=3"]
    cfg = validate(
        compose_config(
            [
                f"model={request.param}",
                f"model.cache_dir={tiny_cache}",
                "algorithm=dpo",
                "data=pairs",
                f"data.pairs={synthetic_pairs}",
                "trainer.batch_size=16",
                "trainer.progress_bar=false",
                *encoding,
            ],
            tmp_path,
        )
    )
    trainer = Trainer(cfg)
    trainer.setup()
    yield trainer
    trainer.cleanup()


def test_loss_is_log2_at_init(offline_trainer):
    metrics = offline_trainer.algorithm.evaluate()
    assert abs(metrics["eval/loss"] - math.log(2)) < 1e-6
    assert metrics["eval/reward_margin"] == 0


def test_a_few_steps_beat_chance_on_held_out_pairs(offline_trainer):
    algorithm = offline_trainer.algorithm
    assert len(algorithm.data.held_out) >= 8
    for step in range(6):
        algorithm.step(step)
    assert algorithm.state_dict()["pairs_consumed"] == 6 * 16  # the data position a checkpoint keeps
    metrics = algorithm.evaluate()
    assert metrics["eval/implicit_accuracy"] > 0.5
    assert metrics["eval/loss"] < math.log(2)


def test_reference_errors_land_on_their_pairs_whatever_the_chunks(offline_trainer, monkeypatch):
    """An update scores its pairs under the reference apart from the policy's micro-batches,
    REFERENCE_CHUNK pairs a forward: each error is its own pair's and side's however the pairs
    are chunked. A forward of another batch size rounds otherwise (float32 matrix products of
    another shape: about 1e-7 here), hence rtol=1e-5 rather than equality."""
    worker = offline_trainer.ctx.worker
    pairs = next(offline_trainer.algorithm.provider.train_batches(0))
    sigmas, noise = dpo.pair_noise(worker.cfg.algorithm, pairs.x0_chosen.shape, seed=5)
    whole = dpo.reference_errors(worker, pairs, sigmas, noise)
    assert whole.shape == (2 * len(pairs),)
    monkeypatch.setattr(dpo, "REFERENCE_CHUNK", 3)
    torch.testing.assert_close(dpo.reference_errors(worker, pairs, sigmas, noise), whole, rtol=1e-5, atol=0)
    for i in (0, len(pairs) - 1):  # a pair scored alone, as pair_outputs scores it with the policy
        out = dpo.pair_outputs(worker, pairs.select([i]), sigmas[[i]], noise[[i]])
        found = torch.stack([out["ref_err_chosen"], out["ref_err_rejected"]])
        torch.testing.assert_close(found, whole[[i, len(pairs) + i]], rtol=1e-5, atol=0)
    # the update (micro-batches of 4 pairs, reference chunks of 3) pairs each policy error with
    # its own reference error: at init every logit is ~0 (beta times the rounding above)
    metrics = worker.apply_update(dpo.update, pairs, 5)
    assert abs(metrics["loss"] - math.log(2)) < 1e-3 and abs(metrics["reward_margin"]) < 1e-2
    assert metrics["ref_err_chosen"] == pytest.approx(float(whole[: len(pairs)].mean()), rel=1e-5)


def test_best_and_worst_skip_ties():
    rewards = torch.tensor([0.1, 0.9, 0.5, 0.5, 0.5, 0.5, 0.3, 0.2, 0.0])
    chosen, rejected, ties = best_and_worst(rewards, group_size=3)
    assert chosen.tolist() == [1, 6]
    assert rejected.tolist() == [0, 8] and ties == 1


def test_online_pairs_under_gdpo_follow_the_weights():
    """Two prompts: in each, image 1 is slightly better on a reward of large scale, image 0
    much better on a small-scale one that weighs more. The weighted sum picks image 1;
    GDPO's ranking picks image 0. An image without a finite reward is in no pair."""
    scores = {"large": torch.tensor([100.0, 102.0, 100.0, 102.0]), "small": torch.tensor([1.0, 0.0, 1.0, 0.0])}
    weights = {"large": 0.4, "small": 0.6}
    scores["reward"] = sum(w * scores[name] for name, w in weights.items())
    rollout = ScoredRollout([], None, scores, torch.tensor([True, True, True, False]), weights)
    by_sum, metrics = ranking(rollout, 2, "weighted_sum")
    assert metrics == {} and best_and_worst(by_sum, 2)[0].tolist() == [1, 3]
    by_gdpo, metrics = ranking(rollout, 2, "gdpo")
    assert "reward/small/advantage_std" in metrics
    chosen, rejected, ties = best_and_worst(by_gdpo, 2)
    assert chosen.tolist() == [0] and rejected.tolist() == [1] and ties == 1


def test_split_is_seeded_and_disjoint():
    train, held = split_positions(10, 0.2, seed=0)
    assert len(held) == 2 and sorted([*train, *held]) == list(range(10))
    again = split_positions(10, 0.2, seed=0)
    assert (again[0] == train).all() and (again[1] == held).all()
    assert (split_positions(10, 0.2, seed=1)[1] != held).any()


def test_data_position_is_saved_and_checked(offline_trainer):
    algorithm = offline_trainer.algorithm
    state = algorithm.state_dict()
    assert state["pairs_consumed"] == 0 and state["train_pairs"] == len(algorithm.data.train)
    algorithm.load_state_dict({**state, "pairs_consumed": 48}, step=3)
    assert algorithm.consumed == 48 and algorithm.batches is None  # the next step reads from pair 48 on
    algorithm.load_state_dict({}, step=2)  # a checkpoint from before the position was saved
    assert algorithm.consumed == 32
    with pytest.raises(ValueError, match="the checkpoint trained on 30 pairs.*same data"):
        algorithm.load_state_dict({**state, "train_pairs": 30}, step=1)


@pytest.mark.parametrize("model", ["flux_tiny", "qwen_image_tiny", "wan_tiny"])
def test_online_dpo_step_trains_each_family(model, tiny_cache, tmp_path):
    """One online step on the families with packed latents and their own conditioning (FLUX's
    pooled CLIP and guidance, Qwen-Image's padded prompts with masks and true CFG), and on
    Wan's 5-D clips (scored by a per-frame reward): each group's
    best and worst rollouts become a pair, the loss starts at log 2 (policy = reference) and
    the LoRA moves."""
    guidance = ["model.guidance_scale=2.0"] if model == "qwen_image_tiny" else []
    if model == "wan_tiny":
        guidance = ["reward=frame_brightness"]
    cfg = validate(compose_config(
        [f"model={model}", f"model.cache_dir={tiny_cache}", "algorithm=online_dpo", "trainer.batch_size=8",
         "algorithm.group_size=4", "rollout.num_steps=4", "trainer.progress_bar=false", *guidance], tmp_path,
    ))  # fmt: skip
    trainer = Trainer(cfg)
    trainer.setup()
    try:
        before = trainer.worker.lora_state_dict()
        metrics = trainer.algorithm.step(0)
        after = trainer.worker.lora_state_dict()
    finally:
        trainer.cleanup()
    assert metrics["train/pairs"] == 2 and metrics["train/tied_groups"] == 0
    assert abs(metrics["train/loss"] - math.log(2)) < 1e-4
    assert max(float((after[k] - before[k]).abs().max()) for k in before) > 1e-4


def test_offline_dpo_on_video_pairs_beats_chance_on_held_out_pairs(tiny_cache, tmp_path):
    """Offline DPO on the tiny Wan from clips (mp4 files and frame folders, the chosen one
    brighter), encoded by the Wan VAE's encoder: log 2 at init, and a few steps tell held-out
    pairs apart."""
    from omni.data.synthetic_pairs import write_synthetic_video_pairs

    pairs = write_synthetic_video_pairs(tmp_path / "pairs", n_pairs=40, resolution=32, num_frames=5, seed=0)
    cfg = validate(compose_config(
        ["model=wan_tiny", f"model.cache_dir={tiny_cache}", "reward=frame_brightness", "algorithm=dpo", "data=pairs",
         f"data.pairs={pairs}", "trainer.batch_size=16", "trainer.progress_bar=false"], tmp_path,
    ))  # fmt: skip
    trainer = Trainer(cfg)
    trainer.setup()
    try:
        algorithm = trainer.algorithm
        assert len(algorithm.data.held_out) >= 8
        assert abs(algorithm.evaluate()["eval/loss"] - math.log(2)) < 1e-6
        for step in range(6):
            algorithm.step(step)
        metrics = algorithm.evaluate()
    finally:
        trainer.cleanup()
    assert metrics["eval/implicit_accuracy"] > 0.5
    assert metrics["eval/loss"] < math.log(2)


def test_held_out_pairs_are_capped_and_the_train_split_kept(tiny_cache, tmp_path):
    """data.pairs_eval_max bounds what each evaluation scores (Pick-a-Pic's 20% is 200,000
    pairs); the held-out share stays out of training and the train positions do not move."""
    from omni.algorithms.dpo_pairs import PairData, split_digest
    from omni.data.synthetic_pairs import write_synthetic_pairs

    pairs = write_synthetic_pairs(tmp_path / "pairs", 60, resolution=8, seed=0)
    base = [
        f"model.cache_dir={tiny_cache}",
        "algorithm=dpo",
        "data=pairs",
        f"data.pairs={pairs}",
        "data.latent_cache=null",
        "data.pairs_eval_fraction=0.5",
    ]
    assert compose_config(base).data.pairs_eval_max == 256
    capped = PairData(validate(compose_config([*base, "data.pairs_eval_max=8"], tmp_path)))
    whole = PairData(validate(compose_config([*base, "data.pairs_eval_max=null"], tmp_path)))
    assert len(whole.held_out) == 30 and len(capped.held_out) == 8
    assert capped.held_out.tolist() == whole.held_out[:8].tolist()
    assert split_digest(capped.train) == split_digest(whole.train) and not set(capped.train) & set(whole.held_out)


@pytest.mark.parametrize("offline_trainer", ["sd3_tiny"], indirect=True)
def test_long_evaluation_shows_its_progress(offline_trainer, monkeypatch, capsys):
    """More than one chunk of held-out pairs: a progress bar (when trainer.progress_bar)."""
    from omni.algorithms import dpo_pairs

    monkeypatch.setattr(dpo, "EVAL_CHUNK", 4)
    monkeypatch.setattr(dpo_pairs, "EVAL_CHUNK", 4)
    offline_trainer.cfg.trainer.progress_bar = True
    offline_trainer.algorithm.evaluate()
    assert "eval pairs" in capsys.readouterr().err
