"""What the `model_algorithm` pair preset of a run set: the settings that apply to one model
with one algorithm (omni/conf/model_algorithm/<model>_<algorithm>.yaml, chosen by Hydra's
`optional model_algorithm: ${model}_${algorithm}` default), which the log names since no
command line shows them (the tiny SD3 with Flow-GRPO trains at lr 1e-2 through one)."""

from __future__ import annotations

from typing import Dict, Optional

from omegaconf import DictConfig, OmegaConf

GROUP = "model_algorithm"


def preset_settings(loader, name: str) -> Dict[str, object]:
    """Dotted key -> value of the preset `name`, its own defaults (other presets) first."""
    result = loader.repository.load_config(f"{GROUP}/{name}")
    merged = OmegaConf.create()
    for default in result.defaults_list or []:
        merged = OmegaConf.merge(merged, _nested(preset_settings(loader, default.path)))
    own = OmegaConf.create(result.config)
    with_defaults = OmegaConf.merge(merged, {k: v for k, v in own.items() if k != "defaults"})
    return _flatten(OmegaConf.to_container(with_defaults))


def _nested(flat: Dict[str, object]) -> DictConfig:
    cfg = OmegaConf.create()
    for key, value in flat.items():
        OmegaConf.update(cfg, key, value, force_add=True)
    return cfg


def _flatten(node, prefix: str = "") -> Dict[str, object]:
    if not isinstance(node, dict):
        return {prefix.rstrip("."): node}
    flat = {}
    for key, value in node.items():
        flat.update(_flatten(value, f"{prefix}{key}."))
    return flat


def describe_model_algorithm_preset(cfg: DictConfig) -> Optional[str]:
    """One line naming the preset Hydra applied and each setting it made (and where the
    command line then set another value); None outside a Hydra run."""
    from hydra.core.global_hydra import GlobalHydra
    from hydra.core.hydra_config import HydraConfig

    if not HydraConfig.initialized() or not GlobalHydra.instance().is_initialized():
        return None
    choices = HydraConfig.get().runtime.choices
    name, loader = choices.get(GROUP), GlobalHydra.instance().config_loader()
    pair = f"model={choices.get('model')} with algorithm={choices.get('algorithm')}"
    if not name or name not in loader.get_group_options(GROUP):
        return f"{GROUP}: no preset for {pair}"
    settings = []
    for key, value in preset_settings(loader, name).items():
        now = OmegaConf.select(cfg, key)
        settings.append(f"{key}={value}" + ("" if now == value else f" (overridden: {key}={now})"))
    return f"{GROUP}={name} applied for {pair} (omni/conf/{GROUP}/{name}.yaml): sets {', '.join(settings) or 'nothing'}"
