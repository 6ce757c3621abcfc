"""Defaults live in one place, the schema: an option's YAML under omni/conf/ states only what
differs from the dataclass default of its group (a value copied into the YAML would silently
stop following the schema when the schema's default changes)."""

import dataclasses
import typing

import pytest
from omegaconf import OmegaConf

from omni.config import CONF_DIR, TrainConfig

GROUPS = ("model", "trainer", "logger", "data")


def schema_defaults(group: str) -> dict:
    schema = typing.get_type_hints(TrainConfig)[group]
    defaults = {}
    for f in dataclasses.fields(schema):
        if f.default is not dataclasses.MISSING:
            defaults[f.name] = f.default
        elif f.default_factory is not dataclasses.MISSING:
            defaults[f.name] = f.default_factory()
    return defaults


def plain(value):
    return getattr(value, "value", value)


@pytest.mark.parametrize("group", GROUPS)
def test_option_yaml_states_only_what_differs_from_the_schema(group):
    defaults = schema_defaults(group)
    repeated = []
    for path in sorted((CONF_DIR / group).glob("*.yaml")):
        node = OmegaConf.to_container(OmegaConf.load(path)) or {}
        for key, value in node.items():
            if key in defaults and not isinstance(value, dict):
                default = defaults[key]
                default = [plain(v) for v in default] if isinstance(default, list) else plain(default)
                if value == default:
                    repeated.append(f"{path.name}: {key}: {value!r}")
    assert not repeated, f"{group} options repeat the schema's defaults: {repeated}"
