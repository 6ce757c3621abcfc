"""Every algorithm the edit issue names trains both edit families, in process, one step each on
the recolour edits: Flow-GRPO, DiffusionNFT, online DPO (rollouts) and offline DPO (edit pairs,
`image`, `chosen`, `rejected`), on the tiny FLUX.1 Kontext and the tiny Qwen-Image-Edit-Plus
(its pipeline's fixed source areas shrunk, as in its family tests: `tests/models/qwen_edit_sizes.py`).
The step must change the LoRA and report a finite loss; the CLI runs of
`tests/recipes/test_train_edits.py` add the exported LoRA and the pair scan."""

import math

import pytest

from omni.recolor import write_recolor_pairs
from omni.trainer import Trainer
from omni.validation import validate
from tests.conftest import compose_config
from tests.models.qwen_edit_sizes import small_edit_sources  # noqa: F401 (autouse)

ALGORITHMS = {
    "flow_grpo": ["algorithm=flow_grpo", "algorithm.group_size=2"],
    "diffusion_nft": ["algorithm=diffusion_nft", "algorithm.group_size=2", "rollout.guidance_scale=1.0"],
    "online_dpo": ["algorithm=online_dpo", "algorithm.group_size=2"],
    "dpo": ["algorithm=dpo"],
}


@pytest.mark.slow
@pytest.mark.parametrize("model", ["flux_kontext_tiny", "qwen_image_edit_plus_tiny"])
@pytest.mark.parametrize("algorithm", sorted(ALGORITHMS))
def test_one_step_of_each_algorithm_moves_the_lora(model, algorithm, tiny_cache, tmp_path):
    overrides = [
        f"model={model}",
        f"model.cache_dir={tiny_cache}",
        "data=recolor",
        "reward=edit",
        "trainer.batch_size=4",
        "trainer.micro_batch_size=4",
        "rollout.num_steps=3",
        "trainer.progress_bar=false",
        *ALGORITHMS[algorithm],
    ]
    if algorithm == "dpo":
        overrides.append(f"data.pairs={write_recolor_pairs(tmp_path / 'data', 'pairs', 4, seed=5)}")
    trainer = Trainer(validate(compose_config(overrides, tmp_path)))
    trainer.setup()
    try:
        before = {name: t.clone() for name, t in trainer.worker.lora_state_dict().items()}
        metrics = trainer.run_step(0)
        after = trainer.worker.lora_state_dict()
        assert max(float((after[n] - t).abs().max()) for n, t in before.items()) > 0
        assert all(math.isfinite(v) for v in metrics.values() if isinstance(v, float))
    finally:
        trainer.cleanup()
