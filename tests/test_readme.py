"""The README's timings say where they were taken: every paragraph that gives a wall time or a
rate names the machine (cores, CPU, GPU, runner) and its load (quiet, loaded, shared, ...,
or that the load was not recorded), so a reader can tell whether a figure should hold for them."""

import re
from pathlib import Path

README = Path(__file__).resolve().parents[1] / "README.md"

TIMING = re.compile(
    r"\d[\d.,]*(?:-\d[\d.]*)?\s?(?:ms|s|seconds?|minutes?|hours?)\b(?!\w)|\b(?:under|about) a minute\b"
    r"|\d[\d.,]*(?:-\d[\d.]*)?\s(?:images|frames|pairs|transitions|steps)/s\b"
)
MACHINE = re.compile(r"\bcores?\b|\bCPU\b|\bGPUs?\b|\bH200\b|\brunner\b", re.I)
LOAD = re.compile(r"\bquiet\b|\bloaded\b|\bload\b|\balone\b|\bshared\b|\bidle\b|nothing else", re.I)


def paragraphs(text: str):
    """The README's paragraphs, without fenced code blocks; an indented paragraph (a list
    item's table or continuation) belongs to the one before it."""
    text = re.sub(r"```.*?```", "", text, flags=re.S)
    joined = []
    for part in re.split(r"\n\s*\n", text):
        if part.startswith("  ") and joined:
            joined[-1] += "\n" + part
        elif part.strip():
            joined.append(part)
    return [" ".join(p.split()) for p in joined]


def test_each_timing_names_its_machine_and_load():
    unplaced = [
        p[:160]
        for p in paragraphs(README.read_text())
        if TIMING.search(p) and not (MACHINE.search(p) and LOAD.search(p))
    ]
    assert not unplaced, "timings without their machine and load:\n" + "\n".join(unplaced)


def first_command_overrides(text: str):
    """The overrides of `recipes/train.py` in the README's first shell block (the one a newcomer copies)."""
    block = re.search(r"```bash\n(.*?)```", text, flags=re.S).group(1)
    run = block.split("python recipes/train.py", 1)[1].splitlines()[0]
    return run.split()


def test_the_first_command_trains_the_micro_model_on_the_scenes_task():
    """Issue "A real task on a CPU": the command a newcomer copies trains on the compositional
    scenes and reports GenEval's accuracy before and after (a validated config, no model loaded)."""
    import omni
    from omni.validation import validate
    from tests.conftest import compose_config

    cfg = validate(compose_config(first_command_overrides(README.read_text())))
    assert Path(cfg.model.path) == Path(omni.__file__).parent / "assets" / "micro"
    assert cfg.data.train == "omni:scenes_train" and cfg.eval.prompts == "omni:scenes_eval"
    assert list(cfg.reward.components) == ["scene_geneval"] and cfg.eval.max_images is None
    assert cfg.trainer.steps <= 20  # about 100 s on 2 cores; longer runs are `experiment=scenes`
