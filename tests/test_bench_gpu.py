"""scripts/bench_gpu.py runs end to end (on the tiny SD3 and the CPU here; on a GPU it builds
the real SD3.5 architectures): every figure it reports is measured and positive."""

import importlib.util
import json
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "bench_gpu.py"


@pytest.mark.slow
def test_bench_gpu_reports_every_figure_on_the_tiny_model(tiny_cache, capsys):
    spec = importlib.util.spec_from_file_location("bench_gpu", SCRIPT)
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    script.main(["--tiny", "--cache-dir", str(tiny_cache), "--device", "cpu", "--dtype", "float32",
                 "--resolution", "64", "--steps", "2", "--batch", "2", "--micro-batch", "2", "--repeats", "1"])  # fmt: skip
    report = json.loads(capsys.readouterr().out)
    rollout, update = report["rollout"], report["update"]
    assert rollout["ours_images_per_s"] > 0 and rollout["diffusers_images_per_s"] > 0
    assert rollout["ours_over_diffusers"] == pytest.approx(rollout["ours_images_per_s"] / rollout["diffusers_images_per_s"], rel=0.01)
    assert set(update["transitions_per_s"]) == {"plain", "checkpointing"} and min(update["transitions_per_s"].values()) > 0
    assert report["settings"]["params"] > 0 and report["lora_collect_seconds"] > 0
