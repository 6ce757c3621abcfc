"""`python recipes/train.py --help` lists the groups a user picks, each option and examples,
and not the internal groups (schema/*, model_algorithm)."""

from omni.config import CONF_DIR
from tests import cli_process

INTERNAL = ("hydra", "model_algorithm")  # omni/conf/hydra/: Hydra's own settings; model_algorithm: pair presets


def test_help_lists_every_group_and_option_with_examples():
    result = cli_process.run(["recipes/train.py", "--help"], timeout=120)
    assert result.returncode == 0, result.stderr[-3000:]
    out = result.stdout
    lines = out.splitlines()
    # a config group is a folder of YAML files (not __pycache__, which byte-compiling leaves)
    groups = sorted(p.name for p in CONF_DIR.iterdir() if any(p.glob("*.yaml")) and p.name not in INTERNAL)
    for group in groups:
        row = next((i for i, line in enumerate(lines) if line.split()[:1] == [group]), None)
        assert row is not None, f"--help lists no group {group}"
        listed = " ".join(lines[row : row + 3]).replace("|", " ").split()
        for option in sorted(p.stem for p in (CONF_DIR / group).glob("*.yaml")):
            assert option in listed, f"--help lists no {group}={option}"
    assert "schema/" not in out and not [line for line in lines if line.split()[:1] == ["model_algorithm"]]
    assert "experiment=sd3_flow_grpo model.path=" in out and "Examples:" in out
