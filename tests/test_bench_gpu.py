"""scripts/bench_gpu.py (`omni.bench.gpu`, its FLOPs model in `omni.flops`): its estimate for
the published SD3.5-Medium and FLUX.1-dev (meta device), its time budget, and (slow) a run end
to end on each family's tiny model in bf16 on the CPU here, where every figure it reports is
measured and positive. On a GPU it builds the real architectures."""

import json
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "bench_gpu.py"


@pytest.fixture(scope="module")
def script():
    from omni.bench import gpu

    return gpu


def test_every_published_architecture_of_the_families_has_settings(script):
    from omni.flops import ARCH_SETTINGS
    from omni.models import get_family

    assert set(ARCH_SETTINGS) == {arch for name in script.FAMILIES for arch in get_family(name).published_configs}


def test_estimate_of_the_default_architectures_fits_eight_minutes(script, capsys):
    """The real shapes: SD3's 77 CLIP + 256 T5 tokens under CFG (two passes, two update
    variants), FLUX.1-dev's 512 T5 tokens in one pass; 1024 image tokens at 512 px each."""
    script.main(["--estimate", "--device", "cpu"])
    report = json.loads(capsys.readouterr().out)
    sd3, flux = report["sd3.5-medium"], report["flux.1-dev"]
    assert (sd3["settings"]["text_tokens"], sd3["settings"]["passes"]) == (77 + 256, 2)
    assert (flux["settings"]["text_tokens"], flux["settings"]["passes"]) == (512, 1)
    assert sd3["settings"]["image_tokens"] == flux["settings"]["image_tokens"] == (512 // 16) ** 2
    assert 2.2e9 < sd3["settings"]["params"] < 2.3e9 and 11.8e9 < flux["settings"]["params"] < 12e9
    assert set(sd3["estimated_s"]) == {"rollout", "update both", "update conditional"} and set(flux["estimated_s"]) == {
        "rollout",
        "update both",
    }
    # FLUX does more work per image than SD3.5-Medium; the whole timed work leaves minutes for the builds
    assert flux["estimated_s"]["rollout"] > sd3["estimated_s"]["rollout"] > 0
    assert sum(sd3["estimated_s"].values()) + sum(flux["estimated_s"].values()) < 240
    assert "rollout" not in sd3 and "rollout" not in flux  # nothing built or run


def test_flops_of_a_forward_and_of_an_update():
    """A forward's FLOPs are counted on the meta device: linear in the sequences, and for an
    MMDiT (SD3.5-Medium at 1024 px: 4096 image tokens, 333 text tokens) about half of what
    2 x weights x tokens would say, which charges the text stream's and the image stream's
    weights and the per-sample modulation to every token. An update: its forwards and one more
    for each differentiated pass's backward (CFG's two passes, or the conditional one and the
    unconditional without gradients), and one more under checkpointing."""
    from omni.bench.gpu import meta_inputs
    from omni.flops import forward_flops, update_forwards
    from omni.memory import arch_config
    from omni.models import get_family

    family = get_family("sd3")
    config = arch_config(family, "sd3.5-medium")
    meta = family.meta_transformer(config=config)
    settings = {"resolution": 1024, "vae_factor": 8, "text_tokens": 333, "passes": 2}
    inputs = meta_inputs(family, config, settings)
    one, three = forward_flops(family, meta, inputs(meta, 1), 4.5), forward_flops(family, meta, inputs(meta, 3), 4.5)
    assert three == 3 * one and forward_flops(family, meta, inputs(meta, 1), 1.0) == one  # per pass
    weights = sum(p.numel() for p in meta.parameters())
    assert 0.4 < one / (2 * weights * (4096 + 333)) < 0.6
    assert [update_forwards("both", 2, c) for c in (False, True)] == [4, 6]
    assert [update_forwards("conditional", 2, c) for c in (False, True)] == [3, 4]
    assert [update_forwards("both", 1, c) for c in (False, True)] == [2, 3]


def test_time_budget_skips_a_phase_that_does_not_fit(script):
    budget = script.Budget(seconds=10, peak_flops=1e12)
    notes = []
    assert budget.fits("update both", 5 * 1e12 * script.ASSUMED_MFU, notes) and notes == []
    assert not budget.fits("update conditional", 50 * 1e12 * script.ASSUMED_MFU, notes)
    assert (
        len(notes) == 1
        and notes[0].startswith("update conditional: skipped, estimated 50 s")
        and "--time-budget-s" in notes[0]
    )


@pytest.mark.slow
def test_bench_gpu_reports_every_figure_for_both_families(script, tiny_cache, capsys):
    script.main(
        [
            "--tiny",
            "--cache-dir",
            str(tiny_cache),
            "--device",
            "cpu",
            "--dtype",
            "bfloat16",
            "--resolution",
            "64",
            "--steps",
            "2",
            "--batch",
            "2",
            "--micro-batch",
            "2",
            "--repeats",
            "1",
        ]
    )
    report = json.loads(capsys.readouterr().out)
    assert set(report) == {"tiny-sd3", "tiny-flux", "elapsed_s"}
    for arch, cfg_gradients in (("tiny-sd3", {"both", "conditional"}), ("tiny-flux", {"both"})):
        section = report[arch]
        rollout, updates = section["rollout"], section["update"]
        assert section["skipped"] == [] and section["settings"]["params"] > 0 and section["lora_collect_seconds"] > 0
        assert rollout["ours_images_per_s"] > 0 and rollout["diffusers_images_per_s"] > 0 and rollout["mfu"] > 0
        assert rollout["ours_over_diffusers"] == pytest.approx(
            rollout["ours_images_per_s"] / rollout["diffusers_images_per_s"], rel=0.01
        )
        assert set(updates) == cfg_gradients
        for update in updates.values():
            assert set(update["transitions_per_s"]) == set(update["mfu"]) == {"plain", "checkpointing"}
            assert min(update["transitions_per_s"].values()) > 0 and min(update["mfu"].values()) > 0
        assert "error" not in section["ratio_noise_floor"]
        # the LoRA is zero and nothing trained: the actor's re-scoring gives the rollout's log-probs
        assert section["ratio_noise_floor"]["max_abs_log_prob_diff"] < 1e-2
        assert set(updates["both"]["estimated_gib"]) == {"plain", "checkpointing"}


def test_ratio_noise_floor_is_zero_in_fp32_and_sees_a_changed_actor(script, tiny_cache):
    """One rollout re-scored by the actor in micro-batches: in fp32 on the CPU the ratios are
    1 to rounding; once the actor's weights move they are not (the check can fail)."""
    import torch

    from omni.models import get_family

    family = get_family("sd3")
    args = script.parse_args(["--tiny", "--cache-dir", str(tiny_cache), "--device", "cpu", "--dtype", "float32",
                              "--resolution", "64", "--steps", "3", "--batch", "4", "--micro-batch", "2"])  # fmt: skip
    configs = script.component_configs(family, "sd3.5-medium", True, str(tiny_cache))
    settings = script.arch_settings("sd3.5-medium", family, configs, args)
    pipe = script.build_pipeline(family, configs, 4, torch.device("cpu"), torch.float32)
    cond = script.random_conditioning(family, configs[0], settings, torch.device("cpu"), torch.float32)
    floor = script.ratio_noise_floor(family, pipe, cond, settings, torch.device("cpu"), torch.float32)
    assert floor["max_abs_ratio_minus_1"] < 1e-4

    sample = script.sample_trajectories

    def moved(*a, **k):  # the engine samples, then the actor's weights move before it re-scores
        out = sample(*a, **k)
        with torch.no_grad():
            for p in pipe.transformer.parameters():
                p.add_(0.05 * torch.randn_like(p))
        return out

    script.sample_trajectories = moved
    try:
        floor = script.ratio_noise_floor(family, pipe, cond, settings, torch.device("cpu"), torch.float32)
    finally:
        script.sample_trajectories = sample
    assert floor["max_abs_ratio_minus_1"] > 1e-3


def test_estimate_error_is_in_percent_of_the_measured_peak(script):
    assert script.estimate_error({"plain": 20.0, "checkpointing": None}, {"plain": 15.0, "checkpointing": 5.0}) == {
        "plain": -25.0
    }


@pytest.mark.slow
def test_gpu_suite_without_a_gpu_runs_the_cpu_checks_and_says_so(tmp_path):
    import subprocess
    import sys

    out = tmp_path / "suite.json"
    subprocess.run(
        [sys.executable, str(SCRIPT.parent / "gpu_suite.py"), "--out", str(out), "--budget-s", "300"], check=True
    )
    report = json.loads(out.read_text())
    assert report["gpu"] is None and "no GPU" in report["note"]
    assert set(report["parts"]) == {"bench_sd3.5-medium", "bench_flux.1-dev", "fsdp"}
    failed = {name: part for name, part in report["parts"].items() if part.get("returncode") != 0 or not part["result"]}
    assert not failed, json.dumps(failed, indent=1)  # each failed part's JSON and stderr tail
    assert report["parts"]["fsdp"]["result"]["passed"] is True
    assert "async_overlap" in report["not_measured"]
