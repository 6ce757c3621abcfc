"""Finding a component by its config name: one module per component in a package.

A model family, an algorithm, a reward or a rollout engine is the module
`<package>.<name><suffix>`, which defines `attribute`; adding one is adding its module
(and its yaml), with no list to edit. Unknown names fail with the available ones.
"""

from __future__ import annotations

import importlib
import pkgutil
from typing import Any, List


class Registry:
    def __init__(self, package: str, attribute: str, kind: str, key: str, suffix: str = ""):
        self.package, self.attribute, self.kind, self.key, self.suffix = package, attribute, kind, key, suffix

    def names(self) -> List[str]:
        """Every module of the package that defines the attribute, by config name."""
        found = []
        for info in pkgutil.iter_modules(importlib.import_module(self.package).__path__):
            if info.name.endswith(self.suffix) and hasattr(self._module(info.name), self.attribute):
                found.append(info.name[: len(info.name) - len(self.suffix)] if self.suffix else info.name)
        return sorted(found)

    def _module(self, module_name: str):
        return importlib.import_module(f"{self.package}.{module_name}")

    def get(self, name: str) -> Any:
        try:
            module = self._module(f"{name}{self.suffix}")
        except ModuleNotFoundError as error:
            if error.name != f"{self.package}.{name}{self.suffix}":
                raise
            module = None
        if module is None or not hasattr(module, self.attribute):
            raise KeyError(f"{self.key}={name}: no such {self.kind}; available: {self.names()}")
        return getattr(module, self.attribute)
