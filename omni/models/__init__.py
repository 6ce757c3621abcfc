"""Model families, one module each (`omni/models/<family>.py` defines `FAMILY`), chosen by
`model.family`. The interface is `omni.models.base.ModelFamily`. Importing it makes
`${omni_asset:<name>}` (a checkpoint shipped under omni/assets/) resolvable in model configs."""

from __future__ import annotations

from omni.models.assets import register_resolver
from omni.models.base import Conditioning, ModelFamily
from omni.registry import Registry

register_resolver()
FAMILIES = Registry(__name__, "FAMILY", "model family", "model.family")


def get_family(name: str) -> ModelFamily:
    return FAMILIES.get(name)


__all__ = ["Conditioning", "ModelFamily", "FAMILIES", "get_family"]
