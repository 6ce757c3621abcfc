"""The real CLI with DPO on the tiny model: online and offline DPO raise the held-out reward, resume
is exact (streamed, with decoding workers, and from the latent cache), and a bad preference
row stops the run before any model loads."""

import json

import pytest
import torch

from tests import cli_process
from tests.recipes.test_train import final_lora, paired_gain, train, train_in_parallel


@pytest.mark.slow
def test_online_dpo_raises_held_out_reward(tmp_path, tiny_cache):
    """Seeds 0 and 1, 25 steps: the held-out reward rises (paired t > 3) by clearly more than
    the +1e-4 the paper's beta gave on the tiny model."""
    runs = {
        tmp_path / f"seed{seed}": (1, ["algorithm=online_dpo", "trainer.steps=25", f"seed={seed}"]) for seed in (0, 1)
    }
    train_in_parallel(runs, tiny_cache)
    for run_dir in runs:
        gain, t_stat = paired_gain(run_dir)
        assert gain > 1e-3 and t_stat > 3, f"{run_dir.name}: mean gain {gain:.6f}, t={t_stat:.2f}"


@pytest.mark.slow
def test_offline_dpo_makes_generations_more_like_the_chosen_images(tmp_path, tiny_cache, synthetic_pairs):
    """Each pair is one image made lighter (chosen) and darker (rejected): 20 steps from the
    latent cache make held-out generations brighter (paired t > 3) on seeds 0 and 1, with 1
    and 2 threads. (With the random VAE's encoder instead of the decoder's inversion, the
    same runs make them darker.)"""
    cache = tmp_path / "latents"
    common = [
        "algorithm=dpo",
        "data=pairs",
        f"data.pairs={synthetic_pairs}",
        f"data.latent_cache={cache}",
        "trainer.steps=20",
    ]
    cached = cli_process.run(["scripts/cache_latents.py", f"model.cache_dir={tiny_cache}", *common])
    assert cached.returncode == 0, cached.stderr[-3000:]
    runs = {tmp_path / "seed0": (1, [*common, "seed=0"]), tmp_path / "seed1": (2, [*common, "seed=1"])}
    train_in_parallel(runs, tiny_cache)
    for run_dir in runs:
        gain, t_stat = paired_gain(run_dir)
        assert gain > 2e-3 and t_stat > 3, f"{run_dir.name}: mean gain {gain:.6f}, t={t_stat:.2f}"


def _same_lora(a, b, step):
    straight, resumed = final_lora(a, step), final_lora(b, step)
    assert straight.keys() == resumed.keys()
    assert all(torch.equal(straight[k], resumed[k]) for k in straight)


@pytest.mark.slow
def test_offline_dpo_resume_is_exact(tmp_path, tiny_cache, synthetic_pairs):
    """The resumed half decodes in 2 worker processes: the data position in the checkpoint
    and the loader's order give it the very pairs the straight run took."""
    common = [
        "algorithm=dpo",
        "data=pairs",
        f"data.pairs={synthetic_pairs}",
        "trainer.batch_size=8",
        "model.vae_inversion_steps=2",
        "data.latent_cache=null",
    ]  # streamed: the cache has a resume test of its own
    train(tmp_path / "straight", tiny_cache, *common, "trainer.steps=4")
    train(tmp_path / "resumed", tiny_cache, *common, "trainer.steps=2")
    state = torch.load(tmp_path / "resumed" / "checkpoints" / "step_000002" / "trainer_state.pt", weights_only=False)
    assert state["algorithm"]["pairs_consumed"] == 16
    out = train(
        tmp_path / "resumed", tiny_cache, *common, "trainer.steps=4", "trainer.resume=auto", "data.num_workers=2"
    )
    assert "eval/implicit_accuracy" in out.stdout
    _same_lora(tmp_path / "straight", tmp_path / "resumed", 4)


@pytest.mark.slow
def test_offline_dpo_from_the_latent_cache_resumes_exactly(tmp_path, tiny_cache, synthetic_pairs):
    """The first run builds the cache; the others memory-map it, and one on other data is refused."""
    cache = tmp_path / "latents"
    common = [
        "algorithm=dpo",
        "data=pairs",
        f"data.pairs={synthetic_pairs}",
        "trainer.batch_size=8",
        f"data.latent_cache={cache}",
        "model.vae_inversion_steps=2",
    ]
    train(tmp_path / "straight", tiny_cache, *common, "trainer.steps=4")
    assert (cache / "manifest.json").is_file()
    train(tmp_path / "resumed", tiny_cache, *common, "trainer.steps=2")
    train(tmp_path / "resumed", tiny_cache, *common, "trainer.steps=4", "trainer.resume=auto")
    _same_lora(tmp_path / "straight", tmp_path / "resumed", 4)
    refused = train(tmp_path / "other", tiny_cache, *common, "rollout.resolution=32", check=False)
    assert (
        refused.returncode != 0
        and "made with rollout.resolution=64, this run has rollout.resolution=32" in refused.stderr
    )
    assert (
        "made with model.vae_inversion_steps=2, this run has model.vae_inversion_steps=3"
        in train(tmp_path / "other-encoding", tiny_cache, *common, "model.vae_inversion_steps=3", check=False).stderr
    )
    assert "Loading pipeline components" not in refused.stdout + refused.stderr


@pytest.mark.slow
def test_bad_row_is_named_before_loading(tmp_path, tiny_cache, synthetic_pairs):
    rows = synthetic_pairs.read_text().splitlines()
    bad = json.loads(rows[2])
    bad["chosen"] = "images/missing.png"
    rows[2] = json.dumps(bad)
    broken = synthetic_pairs.parent / "broken.jsonl"
    broken.write_text("\n".join(rows) + "\n")
    common = ["algorithm=dpo", "data=pairs", f"data.pairs={broken}", "model.vae_inversion_steps=2"]
    result = train(tmp_path / "bad", tiny_cache, *common, check=False)
    output = result.stdout + result.stderr
    assert result.returncode != 0 and "broken.jsonl, line 3" in output
    assert "Loading pipeline components" not in output
    skipped = train(
        tmp_path / "skip", tiny_cache, *common, "data.skip_bad_rows=true", "trainer.steps=1", "logger.console_every=1"
    )
    assert "data/skipped_bad=1" in skipped.stdout
