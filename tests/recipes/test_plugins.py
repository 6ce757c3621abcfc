"""A new model family, algorithm, reward and rollout engine are new files only: each is written
here in a throwaway package outside the project, found through its entry point (omni.registry),
its options typed at composition, and the real CLI trains 1 step with all four. No file of the
project is edited."""

import os
import subprocess
import sys
import textwrap
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]

MODULES = {
    "family.py": """
        from omni.models.sd3 import SD3Family
        from throwaway_omni import mark

        class Throwaway(SD3Family):
            name = "throwaway_family"

            def encode_prompts(self, *args, **kwargs):
                mark("family")
                return super().encode_prompts(*args, **kwargs)

        FAMILY = Throwaway()
    """,
    "algorithm.py": """
        from dataclasses import dataclass

        from omni.algorithms.flow_grpo import FlowGRPO, FlowGRPOConfig
        from omni.config.errors import require
        from throwaway_omni import mark

        @dataclass
        class ThrowawayOptions(FlowGRPOConfig):
            marker: int = 0

        class Throwaway(FlowGRPO):
            Options = ThrowawayOptions

            @classmethod
            def check_config(cls, cfg):
                require(cfg.algorithm.marker == 7, f"algorithm.marker={cfg.algorithm.marker} must be 7")
                super().check_config(cfg)

            def step(self, step):
                mark("algorithm")
                return super().step(step)

        ALGORITHM = Throwaway
    """,
    "reward.py": """
        from dataclasses import dataclass

        from omni.rewards.base import Reward, RewardOptions
        from throwaway_omni import mark

        class Throwaway(Reward):
            @dataclass
            class Options(RewardOptions):
                scale: float = 1.0

            def score(self, images, prompts):
                mark("reward")
                return images.mean(dim=(1, 2, 3)) * self.options.scale

        REWARD = Throwaway
    """,
    "engine.py": """
        from dataclasses import dataclass

        from omni.config.rollout import RolloutConfig
        from omni.rollout import diffusers_engine
        from throwaway_omni import mark

        @dataclass
        class Options(RolloutConfig):
            marker: int = 0

        can_share_actor = diffusers_engine.can_share_actor

        def check_config(cfg, family):
            assert cfg.rollout.marker == 3, cfg.rollout.marker

        def build(cfg, family, model_path, device, dtype, actor=None):
            mark("engine")
            return diffusers_engine.build(cfg, family, model_path, device, dtype, actor=actor)
    """,
}

CONFS = {
    "model/throwaway_family.yaml": """
        defaults:
          - sd3_tiny
          - _self_
        family: throwaway_family
    """,
    "algorithm/throwaway_algorithm.yaml": """
        defaults:
          - /schema/algorithm@_here_: throwaway_algorithm
          - _self_
        name: throwaway_algorithm
        marker: 7
    """,
    "reward/throwaway_reward.yaml": """
        defaults:
          - /schema/reward@components.throwaway_reward: throwaway_reward
    """,
    "rollout/throwaway_engine.yaml": """
        defaults:
          - /schema/rollout@_here_: throwaway_engine
          - _self_
        engine: throwaway_engine
        marker: 3
    """,
}

ENTRY_POINTS = """
[omni_recipes.models]
throwaway_family = throwaway_omni.family
[omni_recipes.algorithms]
throwaway_algorithm = throwaway_omni.algorithm
[omni_recipes.rewards]
throwaway_reward = throwaway_omni.reward
[omni_recipes.rollout]
throwaway_engine = throwaway_omni.engine
"""


def write_plugin(root: Path) -> None:
    package = root / "throwaway_omni"
    package.mkdir(parents=True)
    (package / "__init__.py").write_text(
        "import os\nfrom pathlib import Path\n\n\ndef mark(kind):\n"
        "    (Path(os.environ['THROWAWAY_MARKS']) / kind).touch()\n"
    )
    for name, text in MODULES.items():
        (package / name).write_text(textwrap.dedent(text))
    info = root / "throwaway_omni-0.0.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: throwaway-omni\nVersion: 0.0\n")
    (info / "entry_points.txt").write_text(ENTRY_POINTS)
    for name, text in CONFS.items():
        (root / "conf" / name).parent.mkdir(parents=True, exist_ok=True)
        (root / "conf" / name).write_text(textwrap.dedent(text))


def test_a_component_of_each_kind_is_new_files_only(tmp_path, tiny_cache):
    root, marks = tmp_path / "plugin", tmp_path / "marks"
    write_plugin(root)
    marks.mkdir()
    before = subprocess.run(["git", "status", "--porcelain"], cwd=REPO, capture_output=True, text=True).stdout
    env = {**os.environ, "THROWAWAY_MARKS": str(marks), "PYTHONPATH": os.pathsep.join([str(root), str(REPO)])}
    command = [
        sys.executable,
        "recipes/train.py",
        f"hydra.run.dir={tmp_path / 'run'}",
        f"model.cache_dir={tiny_cache}",
        f"hydra.searchpath=[file://{root / 'conf'}]",
        "model=throwaway_family",
        "algorithm=throwaway_algorithm",
        "reward=throwaway_reward",
        "rollout=throwaway_engine",
        "trainer.steps=1",
        "trainer.batch_size=4",
        "algorithm.group_size=2",
        "eval.every=0",
        "trainer.progress_bar=false",
    ]
    result = subprocess.run(command, cwd=REPO, capture_output=True, text=True, env=env, timeout=600)
    assert result.returncode == 0, f"{result.stdout[-3000:]}\n{result.stderr[-3000:]}"
    assert sorted(p.name for p in marks.iterdir()) == ["algorithm", "engine", "family", "reward"]
    assert subprocess.run(["git", "status", "--porcelain"], cwd=REPO, capture_output=True, text=True).stdout == before
