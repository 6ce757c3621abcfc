"""Dependency versions known to break a path this project takes, refused at validation.

Each `KnownBad` entry names the installed versions that break (one package, or a combination
of packages, each with a `packaging` specifier), the path they break, which runs take that
path (`applies`), why (with the public issue or pull request that shows it), and the fix.
`check_known_bad` runs first in `omni.validation.check`, so a bad combination fails before
anything imports the broken package, with a message naming each package, its installed
version and the fix. Versions are read from the installed distributions' metadata
(`installed_version`); nothing is imported. A pre-release or development build is never
matched (a build from a branch may already carry the fix).

Add an entry only with a public issue that shows the breakage, checked against this
project's own path; each entry has a test that triggers it with faked installed versions.
"""

from __future__ import annotations

from dataclasses import dataclass
from importlib import metadata
from typing import Callable, Mapping, Optional, Tuple

from packaging.specifiers import SpecifierSet
from packaging.version import InvalidVersion, Version

from omni.config.errors import ConfigError

VersionLookup = Callable[[str], Optional[str]]


def installed_version(package: str) -> Optional[str]:
    """The installed distribution's version, or None when it is not installed."""
    try:
        return metadata.version(package)
    except metadata.PackageNotFoundError:
        return None


def every_run(cfg) -> bool:
    return True


@dataclass(frozen=True)
class KnownBad:
    # package -> specifier; the entry matches when every package is installed at a matching version
    versions: Mapping[str, str]
    path: str  # what breaks, in this project's terms
    applies: Callable[[object], bool]  # (TrainConfig) -> whether the run takes that path
    when: str  # which runs take it, for the message
    why: str  # what happens, and the public issue that shows it
    fix: str  # what to install instead

    def matches(self, version_of: VersionLookup) -> Optional[Tuple[Tuple[str, str], ...]]:
        """((package, installed version), ...) when every package matches; else None."""
        found = []
        for package, spec in self.versions.items():
            installed = version_of(package)
            if installed is None:
                return None
            try:
                if not SpecifierSet(spec).contains(Version(installed)):
                    return None
            except InvalidVersion:
                return None
            found.append((package, installed))
        return tuple(found)


KNOWN_BAD: Tuple[KnownBad, ...] = (
    KnownBad(
        versions={"peft": "==0.18.0", "transformers": "<4.52"},
        path="the import of peft (every LoRA is added, trained and synced with it)",
        applies=every_run,
        when="every run",
        why="peft 0.18.0 imports transformers.modeling_layers at import time, a module transformers added in 4.52 "
        "(huggingface/peft#2975, fixed by huggingface/peft#2976 in 0.18.1): `import peft` raises "
        "ModuleNotFoundError",
        fix="pip install 'peft>=0.18.1' (or 'transformers>=4.52')",
    ),
    KnownBad(
        versions={"diffusers": "<0.37"},
        path="the Qwen-Image transformer's forward (the rollout engine and the actor)",
        applies=lambda cfg: cfg.model.family == "qwen_image",
        when="model.family=qwen_image",
        why="before 0.37 QwenImageTransformer2DModel takes the text lengths for its RoPE from a txt_seq_lens "
        "argument we do not pass (the lengths come from encoder_hidden_states_mask, as the pipeline's do since "
        "huggingface/diffusers#12702, released in 0.37.0): every forward raises TypeError "
        "('NoneType' object is not iterable)",
        fix="pip install 'diffusers>=0.37'",
    ),
)


def known_bad_problems(cfg, version_of: Optional[VersionLookup] = None, table=KNOWN_BAD) -> list:
    """One sentence for each entry of `table` that applies to `cfg` and matches the installed
    versions (`version_of`; None: `installed_version`)."""
    version_of = version_of or installed_version
    problems = []
    for entry in table:
        if not entry.applies(cfg):
            continue
        found = entry.matches(version_of)
        if found is None:
            continue
        installed = " with ".join(f"{package} {version}" for package, version in found)
        specs = ", ".join(f"{package}{spec}" for package, spec in entry.versions.items())
        problems.append(
            f"known-bad dependencies: {installed} installed ({specs}) break {entry.path}, taken by {entry.when}: "
            f"{entry.why}. Fix: {entry.fix}"
        )
    return problems


def check_known_bad(cfg, version_of: Optional[VersionLookup] = None, table=KNOWN_BAD) -> None:
    """Refuse a run whose installed dependencies are known to break a path it takes (ConfigError)."""
    problems = known_bad_problems(cfg, version_of, table)
    if problems:
        raise ConfigError("; ".join(problems))
