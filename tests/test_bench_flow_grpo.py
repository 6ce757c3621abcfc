"""scripts/bench_flow_grpo.py (`omni.bench.flow_grpo`): both trainers get the same settings (ours through the real
config and validation, flow_grpo's through the config file it writes), a step is timed
between the trainer's step lines after the warm-up, and a run is ended with its whole
process group. The benchmark itself takes minutes: `python scripts/bench_flow_grpo.py`."""

import importlib.util
import re
import sys
import textwrap
from pathlib import Path

import pytest

from omni.bench import flow_grpo as bench
from omni.validation import validate
from tests.conftest import compose_config

S = bench.SETTINGS

FAKE_BASE = """
from types import SimpleNamespace as N

def get_config():
    return N(pretrained=N(model=""), dataset="", prompt_fn="", reward_fn={}, logdir="", mixed_precision="fp16",
             allow_tf32=True, use_lora=False, resolution=768, eval_freq=20, save_freq=20,
             per_prompt_stat_tracking=False,
             sample=N(num_steps=40, eval_num_steps=40, guidance_scale=1.0, noise_level=0.0, train_batch_size=1,
                      num_image_per_prompt=1, num_batches_per_epoch=1, test_batch_size=1, global_std=False),
             train=N(batch_size=1, gradient_accumulation_steps=2, num_inner_epochs=2, timestep_fraction=0.5,
                     clip_range=1.0, learning_rate=1.0, beta=1.0, ema=True, cfg=False))
"""


def prompt_dir(tmp_path):
    (tmp_path / "train.txt").write_text("a red cat\na blue dog\n")
    (tmp_path / "test.txt").write_text("a pink bird\n")
    return tmp_path


def test_ours_overrides_compose_and_validate_to_the_shared_settings(tiny_sd3_dir, tmp_path):
    overrides = bench.ours_overrides(tiny_sd3_dir, prompt_dir(tmp_path), tmp_path / "run", steps=4)
    cfg = validate(compose_config([o for o in overrides if not o.startswith("hydra.")], tmp_path / "run"))
    images = S["prompts_per_step"] * S["images_per_prompt"]
    assert (cfg.trainer.batch_size, cfg.algorithm.group_size, cfg.trainer.steps) == (images, S["images_per_prompt"], 4)
    assert cfg.rollout.micro_batch_size == images and cfg.algorithm.num_minibatches == S["minibatches"]
    assert (
        cfg.trainer.micro_batch_size == images * S["denoising_steps"] // S["minibatches"]
    )  # a whole minibatch per pass
    rollout = cfg.rollout
    assert (rollout.num_steps, rollout.resolution, rollout.guidance_scale, rollout.noise_level) == (
        S["denoising_steps"], S["resolution"], S["guidance_scale"], S["noise_level"])  # fmt: skip
    assert (cfg.algorithm.clip_range, cfg.trainer.lr, cfg.model.max_sequence_length) == (
        S["clip_range"],
        S["lr"],
        S["t5_length"],
    )
    assert (cfg.model.lora.rank, cfg.model.lora.alpha, list(cfg.model.lora.target_modules)) == (
        S["lora_rank"],
        S["lora_alpha"],
        S["lora_targets"],
    )
    assert [str(b.value) for b in cfg.logger.backends] == ["console"] and cfg.logger.console_every == 1
    assert cfg.algorithm.cfg_gradient.value == "both"
    conditional = validate(
        compose_config(
            [*(o for o in overrides if not o.startswith("hydra.")), *bench.OUR_VARIANTS["ours_cfg_conditional"]]
        )
    )
    assert conditional.algorithm.cfg_gradient.value == "conditional"


def load_flow_grpo_config(tmp_path, base_source):
    (tmp_path / "config").mkdir()
    (tmp_path / "config" / "base.py").write_text(textwrap.dedent(base_source))
    fields = bench.flow_grpo_fields(Path("/model"), Path("/prompts"), Path("/logs"))
    path = tmp_path / "cfg.py"
    path.write_text(bench.FLOW_GRPO_CONFIG.format(base=str(tmp_path / "config" / "base.py"), fields=fields))
    spec = importlib.util.spec_from_file_location("written_config", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.get_config


def test_flow_grpo_config_sets_the_same_work(tmp_path):
    config = load_flow_grpo_config(tmp_path, FAKE_BASE)()
    sample, train = config.sample, config.train
    assert sample.train_batch_size * sample.num_batches_per_epoch == S["prompts_per_step"] * S["images_per_prompt"]
    assert sample.num_image_per_prompt == S["images_per_prompt"] and sample.num_batches_per_epoch == S["minibatches"]
    assert (
        train.batch_size == sample.train_batch_size and train.gradient_accumulation_steps == 1
    )  # a step per minibatch
    assert (sample.num_steps, config.resolution, sample.guidance_scale, sample.noise_level) == (
        S["denoising_steps"], S["resolution"], S["guidance_scale"], S["noise_level"])  # fmt: skip
    assert (train.clip_range, train.learning_rate, train.timestep_fraction, train.beta) == (
        S["clip_range"],
        S["lr"],
        1.0,
        0.0,
    )
    assert (
        config.pretrained.model == "/model"
        and config.reward_fn == {S["reward"]: 1.0}
        and config.mixed_precision == "no"
    )


def test_flow_grpo_config_refuses_a_field_their_base_lacks(tmp_path):
    get_config = load_flow_grpo_config(tmp_path, FAKE_BASE.replace("global_std=False", "global_std_renamed=False"))
    with pytest.raises(KeyError, match="no field sample.global_std"):
        get_config()


def test_step_lines_stamps_matching_lines_and_ends_the_process_group(tmp_path):
    child = tmp_path / "child.pid"
    # a child that ignores SIGTERM, as a stuck data-loader worker might; the run prints once it is ready
    sleeper = (
        "import os, signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); "
        f"open({str(child)!r}, 'w').write(str(os.getpid())); time.sleep(60)"
    )
    code = textwrap.dedent(f"""
        import itertools, os, subprocess, sys, time
        subprocess.Popen([sys.executable, "-c", {sleeper!r}])
        while not os.path.exists({str(child)!r}) or not open({str(child)!r}).read():
            time.sleep(0.01)
        for i in itertools.count():
            print("noise", i, flush=True)
            print("advantages:", i, flush=True)
            time.sleep(0.02)
    """)
    found = bench.step_lines([sys.executable, "-c", code], tmp_path, None, re.compile("^advantages:"), 3, timeout=60)
    assert [text.split()[1] for _, text in found] == ["0", "1", "2"]
    assert found[0][0] < found[1][0] < found[2][0]
    status = Path(f"/proc/{child.read_text()}/status")  # the run's own child is gone too (or a zombie)
    assert not status.exists() or re.search(r"State:\s+Z", status.read_text())


def test_a_run_that_stops_early_is_named_with_its_stderr(tmp_path):
    code = "import sys; print('advantages: 0', flush=True); sys.stderr.write('no such model\\n'); sys.exit(3)"
    with pytest.raises(RuntimeError, match=r"(?s)printed 1 of 2 step lines.*exit code 3.*no such model") as error:
        bench.step_lines([sys.executable, "-c", code], tmp_path, None, re.compile("^advantages:"), 2, timeout=60)
    assert "-c" in str(error.value)


def test_step_seconds_start_after_the_warm_up():
    assert bench.step_seconds([0.0, 1.0, 3.0, 6.0, 10.0], warmup_lines=2) == [2.0, 3.0, 4.0]
    assert bench.step_seconds([0.0, 1.0, 3.0], warmup_lines=1) == [1.0, 2.0]


def test_summary_gives_the_ratio_or_says_ours_only():
    rounds = [
        {
            "flow_grpo": {"seconds_per_step": [2.0, 2.2], "median": 2.1},
            "ours": {"seconds_per_step": [1.0, 1.1], "median": 1.05},
            "ours_cfg_conditional": {"seconds_per_step": [0.7], "median": 0.7},
        }
    ]
    both = bench.summary(rounds, ["flow_grpo", "ours", "ours_cfg_conditional"])
    assert both["median_ratio_flow_grpo_over_ours"] == pytest.approx(2.0) and "note" not in both
    assert both["median_ratio_flow_grpo_over_ours_cfg_conditional"] == pytest.approx(3.0)
    alone = bench.summary([{"ours": rounds[0]["ours"]}], ["ours"])
    assert "ours only" in alone["note"] and "median_ratio_flow_grpo_over_ours" not in alone


def test_arguments_are_checked_before_any_work(tmp_path, capsys):
    with pytest.raises(SystemExit):
        bench.parse_args(["--flow-grpo", str(tmp_path)])
    assert "no scripts/train_sd3.py" in capsys.readouterr().err
    (tmp_path / "scripts").mkdir()
    (tmp_path / "scripts" / "train_sd3.py").write_text("")
    (tmp_path / "config").mkdir()
    (tmp_path / "config" / "base.py").write_text("")
    with pytest.raises(SystemExit):
        bench.parse_args(["--flow-grpo", str(tmp_path), "--flow-grpo-python", str(tmp_path / "nope")])
    assert "--flow-grpo-python" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        bench.parse_args(["--rounds", "0"])
    assert bench.parse_args([]).flow_grpo is None


@pytest.mark.slow
def test_our_real_run_prints_the_step_lines_the_benchmark_times(tmp_path):
    """Our side's own command (the real CLI, logging through Hydra's format) gives the step
    lines `measure` counts: a pattern that misses them leaves the benchmark with no time."""
    model_dir, data_dir = bench.write_inputs(tmp_path)
    side = bench.ours_side(tmp_path, model_dir, data_dir, steps=2)
    result = bench.measure(side, 0, steps=1, timeout=600)
    assert len(result["seconds_per_step"]) == 1 and result["median"] > 0
