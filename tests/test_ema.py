"""The LoRA's exponential moving average: hand-computed updates, and a run that evaluates and
exports the average while training continues from the trained LoRA."""

import math

import pytest
import torch

from omni import checkpoint
from omni.ema import LoraEMA
from omni.trainer import Trainer
from omni.validation import validate
from tests.conftest import compose_config


def test_average_hand_computed():
    """decay 0.9 over the values 1, 2, 3: 1, then 0.9 + 0.2 = 1.1, then 0.99 + 0.3 = 1.29."""
    ema = LoraEMA(0.9)
    for value in (1.0, 2.0, 3.0):
        ema.update({"a": torch.tensor([value]), "b": torch.tensor([-value])})
    assert math.isclose(ema.average["a"].item(), 1.29, rel_tol=1e-6)
    assert math.isclose(ema.average["b"].item(), -1.29, rel_tol=1e-6)
    assert ema.weights({"a": torch.zeros(1, dtype=torch.bfloat16), "b": torch.zeros(1)})["a"].dtype == torch.bfloat16


def test_before_any_update_the_weights_are_the_trained_ones_and_decay_is_checked():
    trained = {"a": torch.ones(2)}
    assert LoraEMA(0.5).weights(trained) is trained
    for decay in (0.0, 1.0, -0.1):
        with pytest.raises(ValueError, match="decay"):
            LoraEMA(decay)


def test_run_evaluates_and_exports_the_average_and_trains_on(tiny_cache, tmp_path):
    prompts = tmp_path / "eval.txt"
    prompts.write_text("a red cat\na blue dog\na green tree\na white house\n")
    overrides = [
        f"model.cache_dir={tiny_cache}",
        "trainer.ema_decay=0.5",
        "trainer.batch_size=4",
        "algorithm.group_size=2",
        "rollout.num_steps=4",
        f"data.eval={prompts}",
        "eval.images_per_prompt=2",
        "trainer.progress_bar=false",
    ]
    trainer = Trainer(validate(compose_config(overrides, tmp_path)))
    trainer.setup()
    try:
        trained = []
        for step in range(2):  # the trainer's own step, which updates the average
            trainer.run_step(step)
            trained.append(trainer.worker.lora_state_dict())
        for name, first in trained[0].items():  # 0.5 L1 + 0.5 L2
            assert torch.allclose(trainer.ema.average[name], 0.5 * first + 0.5 * trained[1][name])
        with_ema = trainer.evaluate()["reward"]
        after = trainer.worker.lora_state_dict()
        assert all(torch.equal(after[n], t) for n, t in trained[1].items())  # the trained LoRA is back
        trainer.ema = None
        without = trainer.evaluate()["reward"]
        assert not torch.equal(with_ema, without)  # the evaluation above sampled with other weights
        trainer.ema = LoraEMA(0.5)
        trainer.ema.update(trained[0])
        trainer.ema.update(trained[1])
        saved = trainer.save_checkpoint(2)
        exported, state = checkpoint.load_checkpoint(saved, trainer.family)
        name = next(iter(exported))
        assert torch.allclose(exported[name], trainer.ema.average[name])
        assert torch.equal(state["trained_lora"][name], trained[1][name])
    finally:
        trainer.cleanup()
