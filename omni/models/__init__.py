"""Model families, one module each (`omni/models/<family>.py` defines `FAMILY`), chosen by
`model.family`. The interface is `omni.models.base.ModelFamily`."""

from __future__ import annotations

from omni.models.base import Conditioning, ModelFamily
from omni.registry import Registry

FAMILIES = Registry(__name__, "FAMILY", "model family", "model.family")


def get_family(name: str) -> ModelFamily:
    return FAMILIES.get(name)


__all__ = ["Conditioning", "ModelFamily", "FAMILIES", "get_family"]
