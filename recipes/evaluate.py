"""Evaluate a trained checkpoint, or the base model, on held-out prompts, configured by Hydra.

    python recipes/evaluate.py eval=scenes checkpoint=outputs/<date>/<time>/checkpoints/step_000050
    python recipes/evaluate.py eval=scenes                    # the base model (checkpoint=null)

The same as the installed `omni-evaluate` command (omni/cli.py): compose omni/conf/evaluate.yaml
(the training config and `checkpoint`) -> validate (a missing checkpoint is named before any
model loads) -> load -> evaluate as the `eval` group says. Prints the mean of each reward per
category and overall, writes them to eval.json in the run directory, and returns the mean reward.
"""

from omni.cli import evaluate

if __name__ == "__main__":
    evaluate()
