"""The toy recolour edits: the shipped sets are what the script writes, and a target differs
from its source exactly on the shape the instruction names."""

import numpy as np
import torch

from omni import scenes
from omni.data.prompt_sets import load_prompt_set
from omni.recolor import SHIPPED, recolor_edit, write_recolor_set


def test_the_shipped_sets_are_the_scripts_output(tmp_path):
    for name, (n, seed) in SHIPPED.items():
        written = write_recolor_set(tmp_path, name, n, seed)
        shipped = load_prompt_set(f"omni:{name}")
        ours = load_prompt_set(str(written))
        assert [str(e) for e in ours] == [str(e) for e in shipped]
        for a, b in zip(ours[::7], shipped[::7]):
            assert open(a.images[0], "rb").read() == open(b.images[0], "rb").read()
            assert open(a.metadata["target"], "rb").read() == open(b.metadata["target"], "rb").read()


def test_only_the_named_shape_changes_to_the_named_colour():
    rng = np.random.default_rng(5)
    for i in range(20):
        instruction, source, target = recolor_edit(rng, 64, seed=i)
        old, shape, new = instruction.split()[2:5]
        changed = (target - source).abs().amax(dim=0) > 0.1
        assert changed.any()
        inside = target[:, changed]
        # the changed pixels take the new colour (anti-aliased edges mix it with the background)
        assert torch.allclose(inside.mean(dim=1), torch.tensor(scenes.COLORS[new]), atol=0.15), instruction
        assert torch.allclose(source[:, changed].mean(dim=1), torch.tensor(scenes.COLORS[old]), atol=0.15)
        assert shape in scenes.SHAPES
