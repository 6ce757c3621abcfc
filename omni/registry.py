"""Finding a component by its config name: one module per component in a package.

A model family, an algorithm, a reward or a rollout engine is the module
`<package>.<name><suffix>`, which defines `attribute`; adding one is adding its module
(and its yaml), with no list to edit. Unknown names fail with the available ones.

A component outside the package (a plugin) is found the same way through an entry point of
the group `omni_recipes.<package's last part>` (`omni_recipes.algorithms`, `.rewards`,
`.models`, `.rollout`): its name is the config name, its value the module. The installed
entry points are read once per `sys.path` (reading them scans every distribution's metadata,
and composing one config asks for them thousands of times); a package installed into the
running process's path afterwards is found by the next process.
"""

from __future__ import annotations

import functools
import importlib
import importlib.metadata
import pkgutil
import sys
from typing import Any, Dict, List, Tuple


class Registry:
    def __init__(self, package: str, attribute: str, kind: str, key: str, suffix: str = ""):
        self.package, self.attribute, self.kind, self.key, self.suffix = package, attribute, kind, key, suffix

    def names(self) -> List[str]:
        """Every module of the package that defines the attribute, by config name."""
        found = []
        for info in pkgutil.iter_modules(importlib.import_module(self.package).__path__):
            if info.name.endswith(self.suffix) and hasattr(self._module(info.name), self.attribute):
                found.append(info.name[: len(info.name) - len(self.suffix)] if self.suffix else info.name)
        for name, module in plugins(self.package).items():  # components of other packages
            if hasattr(importlib.import_module(module), self.attribute):
                found.append(name)
        return sorted(set(found))

    def _module(self, module_name: str):
        plugin = plugins(self.package).get(
            module_name[: len(module_name) - len(self.suffix)] if self.suffix else module_name
        )
        return importlib.import_module(plugin or f"{self.package}.{module_name}")

    def module(self, name: str):
        """The component's module (for what it declares beside its main attribute)."""
        try:
            module = self._module(f"{name}{self.suffix}")
        except ModuleNotFoundError as error:
            if error.name not in (f"{self.package}.{name}{self.suffix}", plugins(self.package).get(name)):
                raise
            module = None
        if module is None or not hasattr(module, self.attribute):
            raise KeyError(f"{self.key}={name}: no such {self.kind}; available: {self.names()}")
        return module

    def get(self, name: str) -> Any:
        return getattr(self.module(name), self.attribute)


def plugins(package: str) -> Dict[str, str]:
    """Config name -> module of the installed plugins of a package's kind (entry points of the
    group `omni_recipes.<package's last part>`)."""
    group = f"omni_recipes.{package.rpartition('.')[2]}"
    return dict(entry_points(group))


def entry_points(group: str) -> Tuple[Tuple[str, str], ...]:
    """(name, value) of the installed entry points of `group`."""
    return _entry_points(tuple(sys.path), group)


@functools.lru_cache(maxsize=None)
def _entry_points(path: Tuple[str, ...], group: str) -> Tuple[Tuple[str, str], ...]:
    return tuple((point.name, point.value) for point in importlib.metadata.entry_points(group=group))
