"""The config: `conf/` composed by Hydra into typed groups, checked, and carried as KFP parameters.

- `schema.py`: the structured-config dataclasses Hydra validates `conf/` against (every field
  `MISSING`: every default lives in `conf/*.yaml`), registered in Hydra's ConfigStore
- `rules.py`: each group's rules between keys (a group's `check()`), the rules that read a
  second group (`GROUP_RULES`), and `check_config`, which runs them after the ranges
- `bounds.py`: `BOUNDS`, the range of every numeric key, in one table
- `composition.py`: `compose(overrides)`, `compose_choices(overrides)` (the config and Hydra's
  choices, from one composition), unknown-key messages, `defaults(group, **changes)`
- `params.py`: the config as KFP parameters (`group_dicts`) and back (`checked_groups`)

Every name is importable from `components.config` itself.
"""

from components.config.bounds import BOUNDS, NOT_BOUNDED, PIPELINE_SCHEDULES, out_of_bounds
from components.config.composition import (
    CONF_DIR,
    compose,
    compose_choices,
    config_groups,
    defaults,
    extra_keys,
    unknown_key,
)
from components.config.params import as_plain_dict, checked_groups, drop_none, group_dicts, group_from_dict
from components.config.rules import (
    EVAL_METRICS,
    GROUP_RULES,
    PERF_METRICS,
    PULL_POLICIES,
    RESERVED_ENV,
    VOLUME_KINDS,
    ConfigError,
    check_config,
    failed,
    from_hub,
    is_commit,
    problems,
)
from components.config.schema import (
    GROUP_SCHEMAS,
    GROUPS,
    ActivationCheckpointing,
    ClusterConfig,
    Config,
    DataConfig,
    EvalConfig,
    Fp8Recipe,
    Guard,
    KfpConfig,
    ModelConfig,
    Parallelism,
    Precision,
    PreflightConfig,
    Scheduler,
    SourceConfig,
    StoreBackend,
    StoreConfig,
    TokenizerConfig,
    TrainConfig,
    VolumeConfig,
)

__all__ = [
    "BOUNDS",
    "CONF_DIR",
    "EVAL_METRICS",
    "GROUPS",
    "GROUP_RULES",
    "GROUP_SCHEMAS",
    "NOT_BOUNDED",
    "PERF_METRICS",
    "PULL_POLICIES",
    "RESERVED_ENV",
    "VOLUME_KINDS",
    "ClusterConfig",
    "Config",
    "ConfigError",
    "DataConfig",
    "SourceConfig",
    "EvalConfig",
    "Fp8Recipe",
    "KfpConfig",
    "ModelConfig",
    "Guard",
    "ActivationCheckpointing",
    "Parallelism",
    "PIPELINE_SCHEDULES",
    "Precision",
    "PreflightConfig",
    "Scheduler",
    "StoreBackend",
    "StoreConfig",
    "TokenizerConfig",
    "TrainConfig",
    "VolumeConfig",
    "as_plain_dict",
    "check_config",
    "checked_groups",
    "compose",
    "compose_choices",
    "config_groups",
    "defaults",
    "drop_none",
    "extra_keys",
    "failed",
    "from_hub",
    "group_dicts",
    "group_from_dict",
    "is_commit",
    "out_of_bounds",
    "problems",
    "unknown_key",
]
