"""The error a configuration that cannot run raises, before any model loads.

A `CompactHydraException`: when it ends a run, Hydra prints its message alone, not the
traceback (HYDRA_FULL_ERROR=1 keeps the traceback).
"""

from hydra.errors import CompactHydraException


class ConfigError(CompactHydraException, ValueError):
    """A configuration that cannot run; the message names the offending keys."""


def require(condition: bool, message: str) -> None:
    if not condition:
        raise ConfigError(message)
