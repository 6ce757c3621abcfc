"""Checkpoints shipped with the package, under omni/assets/, named in a model config by the
`omni_asset` resolver: `path: ${omni_asset:micro}` is the directory omni/assets/micro of
the installed package, wherever it is installed (a model config with that path loads it offline as any local
diffusers checkpoint)."""

from __future__ import annotations

from importlib import resources
from pathlib import Path

from omegaconf import OmegaConf

RESOLVER = "omni_asset"


def asset_path(name: str) -> str:
    """The directory of the shipped checkpoint `name`; a name that ships nothing is an error
    naming what does."""
    assets = Path(str(resources.files("omni") / "assets"))
    path = assets / name
    if not (path / "model_index.json").is_file():
        shipped = sorted(p.name for p in assets.iterdir() if (p / "model_index.json").is_file())
        raise FileNotFoundError(f"${{{RESOLVER}:{name}}}: no checkpoint {name} in {assets}; shipped: {shipped}")
    return str(path)


def register_resolver() -> None:
    """Make `${omni_asset:<name>}` resolvable (idempotent)."""
    if not OmegaConf.has_resolver(RESOLVER):
        OmegaConf.register_new_resolver(RESOLVER, asset_path)
