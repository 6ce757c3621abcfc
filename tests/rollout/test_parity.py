"""The parity gate (omni/rollout/parity.py) on the tiny SD3 on the CPU, with an engine that
keeps its own transformer (rollout.share_actor=false): a healthy sync passes and its figures
are logged; an engine with a fault stops the run at the sync that shows it, naming the
module or the figures.

The faults are injected into the real diffusers engine by `FaultyEngine`, a test-only
subclass (fault injection, not a fake: it samples with the real pipeline and PEFT adapter)
standing in for an engine that loads weights wrongly: an adapter bound to one module fewer
(its tensors dropped, as a lenient loader skips names it cannot place), a sync it ignores
(a stale adapter), its adapter at the wrong scale (alpha where PEFT scales by alpha / rank),
or, subtler, its LoRA computed in bf16 on a bf16 base where the actor's is fp32.
"""

import pytest
import torch

from omni.config.errors import ConfigError
from omni.rollout import diffusers_engine
from omni.rollout.parity import ParityError, compare, rescored_in_eval_mode
from omni.trainer import run
from omni.validation import validate
from omni.weights import lora_module_names, lora_tensors
from tests.conftest import compose_config
from tests.workers.test_actor_rollout import make_worker, randomise_lora, rollout

OWN_COPY = "rollout.share_actor=false"
DROPPED = "transformer_blocks.0.attn.to_q"  # the module whose LoRA the faulty engine drops
SMALL_RUN = [
    OWN_COPY,
    "trainer.batch_size=4",
    "algorithm.group_size=2",
    "eval.images_per_prompt=1",
    "trainer.progress_bar=false",
    "logger.console_every=1",
    # one step then moves the tiny model's policy well past the gate's tolerances
    "trainer.lr=5e-2",
]


class FaultyEngine(diffusers_engine.DiffusersEngine):
    """The real diffusers engine with one fault in its LoRA syncs (`fault`)."""

    fault = None

    def update_weights(self, named_tensors, base_sync_done, lora):
        if not base_sync_done:
            return super().update_weights(named_tensors, base_sync_done, lora)
        if self.fault == "stale" and self.adapter_name is not None:
            return None  # the adapter of the first LoRA sync stays
        if self.fault == "missing_module":
            named_tensors = {k: v for k, v in named_tensors.items() if not k.startswith(f"{DROPPED}.")}
            lora = type(lora)(**{**vars(lora), "exclude_modules": [*lora.exclude_modules, DROPPED]})
        super().update_weights(named_tensors, base_sync_done, lora)
        if self.fault == "wrong_scale":
            for module in self.transformer.modules():
                if isinstance(getattr(module, "scaling", None), dict) and self.adapter_name in module.scaling:
                    module.scaling[self.adapter_name] = lora.alpha
        if self.fault == "bf16_lora":
            for param in lora_tensors(self.transformer, self.adapter_name).values():
                param.data = param.data.bfloat16()
        return None


@pytest.fixture
def faulty_engine(monkeypatch):
    """Every diffusers engine the run builds is a FaultyEngine; set its `fault`."""
    monkeypatch.setattr(diffusers_engine, "DiffusersEngine", FaultyEngine)
    monkeypatch.setattr(FaultyEngine, "fault", None)
    return FaultyEngine


def test_a_healthy_sync_passes_and_reports_its_figures(tiny_cache, tmp_path):
    cfg, worker = make_worker(tiny_cache, tmp_path, OWN_COPY, "rollout.parity.every=1")
    randomise_lora(worker)
    metrics = worker.sync_weights()
    trained = lora_module_names(worker.lora_state_dict())
    assert len(trained) > 1 and worker.engine.lora_modules == trained
    assert metrics["sync/parity_missing_modules"] == 0
    assert metrics["sync/parity_mean_ratio_dev"] <= 1e-6 and metrics["sync/parity_max_log_prob_diff"] <= 1e-5
    assert metrics["sync/parity_seconds"] > 0
    assert cfg.rollout.parity.max_mean_ratio_deviation > 10 * metrics["sync/parity_mean_ratio_dev"]


def test_a_run_checks_the_first_two_syncs_then_every_nth_and_logs_the_figures(tiny_cache, tmp_path, caplog):
    overrides = [f"model.cache_dir={tiny_cache}", *SMALL_RUN, "trainer.steps=3", "rollout.parity.every=3"]
    with caplog.at_level("INFO", logger="omni"):
        run(compose_config(overrides, tmp_path))
    checked = [r.getMessage() for r in caplog.records if r.getMessage().startswith("parity gate, sync")]
    assert [m.split()[3] for m in checked] == ["1", "2", "3"]  # set-up, step 1, step 2 (the 3rd sync); not step 3
    steps = {r.getMessage().split(":")[0] for r in caplog.records if "sync/parity_mean_ratio_dev=" in r.getMessage()}
    assert steps == {"step 1", "step 2"}


@pytest.mark.parametrize(
    "fault, where, named",
    [
        ("missing_module", "during set-up", f"modules the actor trains; missing: {DROPPED}"),
        ("stale", "during training step 1", "mean |ratio - 1|"),
        ("wrong_scale", "during training step 1", "largest |log-prob difference|"),
    ],
)
def test_a_faulty_engine_stops_the_run_at_that_sync_naming_what_differs(
    fault, where, named, faulty_engine, tiny_cache, tmp_path
):
    faulty_engine.fault = fault
    with pytest.raises(ParityError) as info:
        run(compose_config([f"model.cache_dir={tiny_cache}", *SMALL_RUN, "trainer.steps=2"], tmp_path))
    message = str(info.value)
    assert named in message and where in message, message
    assert "rollout.engine=diffusers" in message and "Training stopped" in message


def test_the_default_tolerances_catch_a_lora_computed_in_bf16(faulty_engine, tiny_cache, tmp_path):
    """A mismatch of the size of Flow-GRPO's clip range (the engine's LoRA in bf16: mean |ratio - 1|
    ~1e-4 here, largest log-prob difference 5e-4) against a healthy bf16 sync's 0 on the CPU: the
    defaults tell them apart (tolerances 10x looser would not)."""
    faulty_engine.fault = "bf16_lora"
    _, worker = make_worker(tiny_cache, tmp_path, OWN_COPY, "model.dtype=bfloat16")
    randomise_lora(worker)
    with pytest.raises(ParityError, match=r"mean \|ratio - 1\| [0-9.e-]+ > rollout.parity.max_mean_ratio_deviation"):
        worker.sync_weights()


def test_without_the_gate_the_faulty_engine_goes_unnoticed(faulty_engine, tiny_cache, tmp_path):
    """The negative control: the same stale engine trains on with rollout.parity.every=0."""
    faulty_engine.fault = "stale"
    cfg, worker = make_worker(tiny_cache, tmp_path, OWN_COPY, "rollout.parity.every=0")
    randomise_lora(worker)
    assert not any(key.startswith("sync/parity_") for key in worker.sync_weights())
    batch = rollout(cfg, worker)
    figures = compare(rescored_in_eval_mode(worker.family, worker.actor, batch, worker.dtype), batch)
    assert figures["sync/parity_mean_ratio_dev"] > 100 * cfg.rollout.parity.max_mean_ratio_deviation


def test_a_figure_past_its_tolerance_is_named_with_the_tolerance(faulty_engine, tiny_cache, tmp_path):
    faulty_engine.fault = "stale"
    _, worker = make_worker(tiny_cache, tmp_path, OWN_COPY, "rollout.parity.max_log_prob_diff=1e-3")
    randomise_lora(worker)
    with pytest.raises(ParityError) as info:
        worker.sync_weights()
    message = str(info.value)
    assert "after weight sync 2" in message and "rollout.parity.max_log_prob_diff=0.001" in message
    assert "rollout.parity.max_mean_ratio_deviation=1e-05" in message and "largest at image" in message


@pytest.mark.parametrize(
    "override, named",
    [
        ("rollout.parity.every=-1", "rollout.parity.every=-1 must be >= 0"),
        ("rollout.parity.images=0", "rollout.parity.images=0 must be >= 1"),
        ("rollout.parity.max_log_prob_diff=0", "rollout.parity.max_log_prob_diff=0.0 must be positive"),
    ],
)
def test_bad_options_fail_validation_naming_the_key(override, named, tmp_path):
    with pytest.raises(ConfigError, match=named.replace("|", "\\|")):
        validate(compose_config([override], tmp_path))


def test_the_gate_leaves_the_actor_in_its_mode(tiny_cache, tmp_path):
    _, worker = make_worker(tiny_cache, tmp_path, OWN_COPY, "rollout.parity.every=1")
    worker.actor.train()
    worker.sync_weights()
    assert worker.actor.training and torch.is_grad_enabled()
