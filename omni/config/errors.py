"""The error a configuration that cannot run raises, before any model loads."""


class ConfigError(ValueError):
    """A configuration that cannot run; the message names the offending keys."""


def require(condition: bool, message: str) -> None:
    if not condition:
        raise ConfigError(message)
