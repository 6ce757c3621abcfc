"""What `data.train`, `data.eval` and `eval.prompts` name: a prompt file (text, JSONL or CSV,
`omni.data.prompts`) or an edit set (instructions with source images, `omni.data.edits`)."""

from __future__ import annotations

from typing import List

from omni.data.edits import is_edit_set, load_edits
from omni.data.prompts import PACKAGE_PREFIX, Prompt, load_prompts, resolve_prompt_file


def load_prompt_set(spec: str, key: str = "data.train", skip_bad_rows: bool = False) -> List[Prompt]:
    """The prompts (or edits) at `spec`, a path or `omni:<name>` for a set the package ships."""
    path = resolve_prompt_file(spec, key) if spec.startswith(PACKAGE_PREFIX) else spec
    if is_edit_set(path):
        return load_edits(str(path), key, skip_bad_rows)
    return load_prompts(spec, key, skip_bad_rows)
