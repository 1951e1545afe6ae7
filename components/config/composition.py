"""Composing `conf/` with Hydra: overrides checked against the schema before Hydra sees them,
the composed config type- and rule-checked, and Hydra's choices (which option of each group)."""

from __future__ import annotations

import dataclasses
import difflib
import functools
import typing
from enum import Enum
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf, open_dict

from components.config.rules import ConfigError, check_config
from components.config.schema import Config

CONF_DIR = Path(__file__).resolve().parents[2] / "conf"


def compose(overrides: list[str] | tuple[str, ...] = ()) -> DictConfig:
    """Compose `conf/` with Hydra overrides, type-check and rule-check it."""
    return compose_choices(overrides)[0]


def compose_choices(overrides: list[str] | tuple[str, ...] = ()) -> tuple[DictConfig, dict[str, str | None]]:
    """`compose(overrides)` and Hydra's runtime choices, from one composition: the option each
    config group took (`{"model": "7b", "experiment": "h200-7b", ...}`, a preset's own choices
    included; Hydra's `hydra/...` groups too). A group removed (`~experiment`) has no entry."""
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra

    bad = [msg for o in overrides if (msg := unknown_key(o.partition("=")[0]))]
    if bad:  # before Hydra, whose own message suggests `+key`: adding a key the code never reads
        raise ConfigError("invalid config: " + "; ".join(bad))
    GlobalHydra.instance().clear()
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        cfg = hydra_compose(config_name="config", overrides=list(overrides), return_hydra_config=True)
    choices = OmegaConf.to_container(cfg.hydra.runtime.choices)
    with open_dict(cfg):  # what hydra_compose itself does without return_hydra_config
        del cfg["hydra"]
    added = extra_keys(cfg)
    if added:  # `+train.lrr=1` or `++train.lrr=1`: a key no code reads would be ignored silently
        raise ConfigError("invalid config: " + "; ".join(added))
    check_config(cfg)
    return cfg, choices


def config_groups() -> dict[str, list[str]]:
    """Each config group (a folder of conf/) and its options (the YAML files in it)."""
    return {d.name: sorted(f.stem for f in d.glob("*.yaml")) for d in sorted(CONF_DIR.iterdir()) if d.is_dir()}


def _no_such_key(key: str, at: int, known: list[str]) -> str:
    """`key is not a config key; did you mean ...?`: its `at`-th part replaced by the closest of `known`."""
    parts = key.split(".")
    close = difflib.get_close_matches(parts[at], known, n=1, cutoff=0.6)
    if not close:
        where = "at the top" if at == 0 else "of " + ".".join(parts[:at])
        return f"{key} is not a config key; the keys {where} are {', '.join(known)}"
    return f"{key} is not a config key; did you mean {'.'.join([*parts[:at], close[0], *parts[at + 1 :]])}?"


def unknown_key(key: str) -> str | None:
    """Why an override's key (`train.lrr`, `modle`) names nothing in the schema, or None when it
    does or cannot be judged here: an add/delete (`+`, `~`), a package (`@`), Hydra's own
    `hydra.*`, or a key inside a dict or list field (`cluster.env.NCCL_DEBUG`), which holds any key."""
    if not key or key.startswith(("+", "~")) or "@" in key or key.split(".")[0] == "hydra":
        return None
    schema = Config
    for at, part in enumerate(key.split(".")):
        if not dataclasses.is_dataclass(schema):
            return None
        hints = typing.get_type_hints(schema)
        groups = config_groups() if at == 0 else {}
        if part not in hints and part not in groups:
            return _no_such_key(key, at, sorted({*hints, *groups}) if at == 0 else list(hints))
        schema = hints.get(part)
    return None


def extra_keys(cfg: DictConfig, schema: type = Config, within: str = "") -> list[str]:
    """A message for each key of the composed config that its schema does not have."""
    hints = typing.get_type_hints(schema)
    found = []
    for key in cfg.keys():
        if key not in hints:
            found.append(_no_such_key(f"{within}{key}", within.count("."), list(hints)))
        elif dataclasses.is_dataclass(hints[key]) and isinstance(cfg[key], DictConfig):
            found += extra_keys(cfg[key], hints[key], f"{within}{key}.")
    return found


@functools.cache
def _conf_defaults() -> Config:
    return OmegaConf.to_object(compose(["~experiment"]))


def defaults(group: str, **values: Any) -> Any:
    """One group as `conf/` sets it by default (no experiment preset), with `values` replaced:
    for code and tests that need a typed group outside a composed run. A value for an enum key
    becomes that enum (`activation_checkpointing="off"` is `ActivationCheckpointing.off`, false
    like the config's), or fails as composing would."""
    base = getattr(_conf_defaults(), group)
    for key, value in values.items():
        kind = type(getattr(base, key, None))
        if issubclass(kind, Enum) and not isinstance(value, kind):
            values[key] = kind(value)
    return dataclasses.replace(base, **values)
