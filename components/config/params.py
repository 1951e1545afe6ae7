"""The config as KFP parameters and back: one plain dict per group into the pipeline
(`group_dicts`), a typed, re-checked group out of it in a stage (`checked_groups`)."""

from __future__ import annotations

import dataclasses
import json
import types
import typing
from typing import Any, TypeVar

from omegaconf import DictConfig, OmegaConf

from components.config.rules import ConfigError, problems
from components.config.schema import GROUP_SCHEMAS, GROUPS

T = TypeVar("T")


def group_dicts(cfg: DictConfig) -> dict[str, dict[str, Any]]:
    """The composed config as one plain dict per group: the pipeline's parameters.

    KFP parameters cannot hold None, so unset optional keys are left out;
    `group_from_dict` restores them as None.
    """
    return {g: drop_none(OmegaConf.to_container(cfg[g], resolve=True, enum_to_str=True)) for g in GROUPS}


def checked_groups(**values: dict[str, Any]) -> dict[str, Any]:
    """The typed groups a stage receives as plain dicts (KFP parameters), re-validated with the
    compose-time types and rules that involve only these groups: a group edited as JSON in the
    Kubeflow UI is held to the same rules as the command line. ConfigError names the key."""
    from omegaconf.errors import OmegaConfBaseException

    typed = {}
    for name, value in values.items():
        try:
            typed[name] = group_from_dict(GROUP_SCHEMAS[name], value)
        except OmegaConfBaseException as e:
            detail = str(e.msg).splitlines()[0]
            raise ConfigError(f"invalid config: {name}.{getattr(e, 'full_key', '') or '?'}: {detail}") from None
    bad = problems(typed)
    if bad:
        raise ConfigError("invalid config: " + "; ".join(bad))
    return typed


def group_from_dict(schema: type[T], values: dict[str, Any]) -> T:
    """Rebuild one typed group from the plain dict a KFP component receives. KFP parameters
    cannot hold None, so `group_dicts` leaves unset optional keys out: they come back as None."""
    hints = typing.get_type_hints(schema)
    unset = {
        f.name: None
        for f in dataclasses.fields(schema)
        if f.name not in values and type(None) in typing.get_args(hints[f.name])
    }
    return OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(schema), {**unset, **_ints_back(schema, values)}))


def _ints_back(schema: type, values: dict[str, Any]) -> dict[str, Any]:
    """KFP carries dict parameters as protobuf Structs, where every number is a float:
    turn integral floats back into ints wherever the schema wants an int."""

    def fix(hint, value):
        if dataclasses.is_dataclass(hint) and isinstance(value, dict):
            return _ints_back(hint, value)
        origin, args = typing.get_origin(hint), typing.get_args(hint)
        if origin is list and isinstance(value, list):
            return [fix(args[0], v) for v in value]
        if origin is dict and isinstance(value, dict):
            return {k: fix(args[1], v) for k, v in value.items()}
        wants_int = hint is int or (origin in (typing.Union, types.UnionType) and int in args)
        return int(value) if wants_int and isinstance(value, float) and value.is_integer() else value

    hints = typing.get_type_hints(schema)
    return {key: fix(hints.get(key), value) for key, value in values.items()}


def as_plain_dict(group) -> dict:
    """A typed group as JSON-able values (enums by value): for specs, manifests and hashes."""
    return json.loads(json.dumps(dataclasses.asdict(group), default=lambda v: getattr(v, "value", str(v))))


def drop_none(d: dict) -> dict:
    """Without its None values, recursively, in lists too (KFP parameters cannot hold None)."""

    def clean(v):
        return drop_none(v) if isinstance(v, dict) else [clean(x) for x in v] if isinstance(v, list) else v

    return {k: clean(v) for k, v in d.items() if v is not None}
