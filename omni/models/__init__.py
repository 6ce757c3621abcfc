"""Model families, one module each (`omni/models/<family>.py` defines `FAMILY`), chosen by
`model.family`. The interface is `omni.models.base.ModelFamily`. Importing it makes
`${omni_asset:<name>}` (a checkpoint shipped under omni/assets/) resolvable in model configs,
and quiets transformers' notice that an image processor falls back to PIL without torchvision:
diffusers' pipelines name those processors' classes (IP-adapter components) when they load,
our rollouts never use them, and the notice would tell every CPU user to install a package
they do not need."""

from __future__ import annotations

import logging

from omni.models.assets import register_resolver
from omni.models.base import Conditioning, ModelFamily
from omni.registry import Registry


class _UnusedImageProcessorNotice(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return "requires torchvision" not in record.getMessage()


register_resolver()
logging.getLogger("transformers.utils.import_utils").addFilter(_UnusedImageProcessorNotice())
FAMILIES = Registry(__name__, "FAMILY", "model family", "model.family")


def get_family(name: str) -> ModelFamily:
    return FAMILIES.get(name)


__all__ = ["Conditioning", "ModelFamily", "FAMILIES", "get_family"]
