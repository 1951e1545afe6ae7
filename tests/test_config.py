"""Config schema: composition, type errors, semantic rules, CLI exit codes, no secrets."""

from __future__ import annotations

import json

import pytest

from components.config import GROUP_SCHEMAS, GROUPS, ConfigError, compose, group_dicts, group_from_dict
from components.parallel import ParallelDims, pipeline_microbatches
from pipelines.cli import main
from tests.conftest import S3_ACCESS_KEY, S3_SECRET_KEY


def test_default_is_the_tiny_cpu_experiment():
    cfg = compose()
    assert cfg.model.name == "tiny" and cfg.cluster.scheduler.value == "local_cwd"
    assert cfg.store.backend.value == "local" and cfg.data.paths == ["corpus/kjv.jsonl"]


@pytest.mark.parametrize(
    "override",
    [
        "data.paths=[a.jsonl]",
        "data.text_field=body",
        "tokenizer.vocab_size=2048",
        "model=125m",
        "model=1b",
        "model=7b",
        "model=70b",
        "train.precision=fp8",
        "train.parallelism=fsdp",
        "train.steps=100",
        "train.lr=0.01",
        "train.resume=never",
        "cluster.scheduler=kubernetes",
        "cluster.nodes=2",
        "cluster.procs_per_node=1",
        "store.backend=minio",
        "experiment=tiny",
    ],
)
def test_fixed_key_names_compose(override):
    compose([override])


def test_groups_roundtrip_through_plain_dicts():
    cfg = compose(["train.precision=fp8", "model=1b"])
    dicts = group_dicts(cfg)
    assert set(dicts) == set(GROUPS)
    json.dumps(dicts)  # plain JSON: what KFP parameters carry
    train = group_from_dict(GROUP_SCHEMAS["train"], dicts["train"])
    assert train.precision.value == "fp8" and train.steps == cfg.train.steps
    assert len(json.dumps(dicts)) < 10_000  # KFP's limit on serialized run parameters


@pytest.mark.parametrize(
    "override,key",
    [
        ("model.num_heads=3", "model.hidden_size"),
        ("model.num_kv_heads=3", "model.num_kv_heads"),
        ("data.seq_len=1", "data.seq_len"),
        ("data.seq_len=4096", "data.seq_len"),
        ("train.warmup_steps=1000", "train.warmup_steps"),
        ("cluster.nodes=0", "cluster.nodes"),
        ("cluster.procs_per_node=0", "cluster.procs_per_node"),
        ("data.val_fraction=1.5", "data.val_fraction"),
        ("train.min_lr=1.0", "train.min_lr"),
        ("train.val_interval=-1", "train.val_interval"),
        ("preflight.min_healthy_nodes=3", "preflight.min_healthy_nodes"),
        ("preflight.memory_safety=0", "preflight.memory_safety"),
        ("tokenizer.vocab_size=100", "tokenizer.vocab_size"),
        ("data.paths=[]", "data.paths"),
    ],
)
def test_semantic_rules_name_the_key(override, key, capsys):
    with pytest.raises(ConfigError, match=key):
        compose([override])
    assert main(["config", override]) == 2
    err = capsys.readouterr().err
    assert key in err and "Traceback" not in err


@pytest.mark.parametrize(
    "override,needle",
    [
        ("train.no_such_key=1", "no_such_key"),
        ("train.steps=many", "train.steps"),
        ("train.precision=fp4", "fp4"),
        ("model=13b", "model/13b"),
        ("cluster.scheduler=slurm", "slurm"),
    ],
)
def test_unknown_keys_and_wrong_types_fail(override, needle, capsys):
    assert main(["config", override]) == 2
    err = capsys.readouterr().err
    assert needle in err and len(err.strip().splitlines()) == 1


@pytest.mark.parametrize("override", ["train.lrr=1", "+train.lrr=1", "++train.lrr=1"])
def test_a_typo_is_one_line_that_names_the_key_it_meant(override, capsys):
    """Never the `+train.lrr` Hydra suggests: that key would be added and then read by nothing."""
    assert main(["config", override]) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    assert captured.err == "liftoff config: invalid config: train.lrr is not a config key; did you mean train.lr?\n"
    with pytest.raises(ConfigError, match="did you mean train.lr"):
        compose([override])


@pytest.mark.parametrize(
    "override,message",
    [
        ("modle=7b", "modle is not a config key; did you mean model?"),
        ("trian.lr=1", "trian.lr is not a config key; did you mean train.lr?"),
        ("model.num_head=8", "model.num_head is not a config key; did you mean model.num_heads?"),
        ("+new=1", "new is not a config key; the keys at the top are data, tokenizer, model, train"),
        ("train.zzz=1", "train.zzz is not a config key; the keys of train are precision, fp8_recipe,"),
    ],
)
def test_unknown_keys_suggest_the_nearest_key(override, message, capsys):
    assert main(["config", override]) == 2
    err = capsys.readouterr().err
    assert message in err and "+" not in err.replace(override, "") and len(err.splitlines()) == 1


def test_keys_inside_dict_fields_stay_open():
    """`+` is how a key is added inside a dict field; the unknown-key check leaves those alone."""
    cfg = compose(["+cluster.env.NCCL_DEBUG=WARN", "+cluster.node_selector={pool: gpu}", "hydra.verbose=true"])
    assert cfg.cluster.env.NCCL_DEBUG == "WARN" and cfg.cluster.node_selector == {"pool": "gpu"}
    cfg = compose(["+preflight.floors.storage_read_mbps=5"])
    assert cfg.preflight.floors == {"storage_read_mbps": 5}


def test_heads_rules_read_forwards(capsys):
    assert main(["config", "model.num_heads=5"]) == 2
    err = capsys.readouterr().err
    assert "model.hidden_size=64 is not divisible by model.num_heads=5" in err
    assert "model.num_heads=5 is not divisible by model.num_kv_heads=4" in err
    assert len(err.splitlines()) == 1


def test_config_prints_composed_yaml(capsys):
    assert main(["config", "train.lr=0.01"]) == 0
    assert "lr: 0.01" in capsys.readouterr().out


def test_unknown_command_is_one_line(capsys):
    assert main(["frobnicate"]) == 2
    assert "unknown command 'frobnicate'" in capsys.readouterr().err


def test_no_credential_in_printed_config_or_logs(s3_env, tmp_path, capsys, caplog):
    caplog.set_level("DEBUG")
    assert main(["config", "store=minio"]) == 0
    store_args = ["store=minio", "store.bucket=sentinel-test", f"store.cache_dir={tmp_path}"]
    assert main(["artifacts", "ls", *store_args]) == 2  # no such bucket: one line naming store.bucket
    assert main(["artifacts", "show", "dataset/none", *store_args]) == 2
    out = capsys.readouterr()
    everything = out.out + out.err + caplog.text
    assert S3_SECRET_KEY not in everything and S3_ACCESS_KEY not in everything
    assert "store.bucket=sentinel-test: no artifact store there" in out.err


def test_groups_survive_kfp_struct_floats():
    """KFP turns every number in a dict parameter into a float; the schema gets ints back."""
    from components.config import TrainConfig

    d = group_dicts(compose(["model=7b"]))
    floated = json.loads(json.dumps(d), parse_int=float)
    train = group_from_dict(TrainConfig, floated["train"])
    assert train.steps == d["train"]["steps"] and isinstance(train.steps, int)
    assert isinstance(train.checkpoint_interval, int) and isinstance(train.micro_batch_size, int)
    model = group_from_dict(GROUP_SCHEMAS["model"], floated["model"])
    assert model.vocab_size == 32000 and isinstance(model.vocab_size, int)


def test_every_default_lives_in_conf():
    """No schema dataclass carries a value of its own: each field is MISSING, and composing
    `conf/` fills every one of them (a key that conf/ forgot fails at compose time)."""
    import dataclasses
    import typing

    from omegaconf import MISSING, OmegaConf

    from components.config import Config, KfpConfig

    hints = typing.get_type_hints(Config)
    schemas = [hints[f.name] for f in dataclasses.fields(Config)]  # every group the composed config has
    assert set(GROUP_SCHEMAS.values()) | {KfpConfig} <= set(schemas)
    own = [
        f"{schema.__name__}.{f.name}"
        for schema in schemas
        for f in dataclasses.fields(schema)
        if f.default is not MISSING or f.default_factory is not dataclasses.MISSING
    ]
    assert not own, f"defaults outside conf/: {own}"
    cfg = compose()
    assert not OmegaConf.missing_keys(cfg)
    typed = OmegaConf.to_object(cfg)
    assert isinstance(typed, Config)
    for group in [*GROUPS, "kfp"]:
        for f in dataclasses.fields(getattr(typed, group)):
            assert getattr(getattr(typed, group), f.name) != MISSING, f"{group}.{f.name}"


def test_a_key_missing_from_conf_fails_at_compose(tmp_path):
    """Delete one key from a copy of conf/: composing fails naming it (no silent default)."""
    import shutil

    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra
    from omegaconf import OmegaConf
    from omegaconf.errors import MissingMandatoryValue

    from components.config import CONF_DIR

    conf = tmp_path / "conf"
    shutil.copytree(CONF_DIR, conf)
    train_yaml = conf / "train" / "default.yaml"
    train_yaml.write_text("".join(ln for ln in train_yaml.open() if not ln.startswith("grad_clip:")))
    GlobalHydra.instance().clear()
    with initialize_config_dir(config_dir=str(conf), version_base="1.3"):
        cfg = hydra_compose(config_name="config")
    with pytest.raises(MissingMandatoryValue, match="grad_clip"):
        OmegaConf.to_object(cfg)


def test_each_group_judges_its_own_keys():
    """Each group checks alone (its `check()`, its rules in GROUP_RULES), and the cross-group
    rules run only when the other group is given."""
    from components.config import defaults

    assert defaults("train", warmup_steps=5, steps=3).check() == [
        "train.warmup_steps: 5 must be >= 0 and < train.steps=3"
    ]
    data = defaults("data", seq_len=4096)
    assert data.check() == []
    assert data.check(model=defaults("model")) == ["data.seq_len: 4096 exceeds model.max_seq_len=128"]


@pytest.mark.parametrize(
    "overrides,message",
    [
        (["train.async_tp=true"], "train.async_tp: needs train.tp > 1 (tensor parallelism to overlap), got 1"),
        (["train.async_tp=true", "train.tp=2", "cluster.nodes=2", "train.compile=false"],
         "train.async_tp: needs train.compile (inductor's micro-pipeline pass rewrites the compiled blocks)"),
        (["train.async_tp=true", "train.tp=2", "cluster.nodes=2"],
         "train.async_tp: needs CUDA GPUs (symmetric memory), got cluster.gpu=0 per replica"),
    ],
)  # fmt: skip
def test_async_tp_off_a_cuda_tp_run_fails_at_compose(overrides, message):
    """Async TP rewrites compiled tp blocks over CUDA symmetric memory: without tp, compile or
    GPUs it is refused before anything runs; on a GPU cluster with all three it composes."""
    with pytest.raises(ConfigError) as err:
        compose(overrides)
    assert message in str(err.value)
    gpus = ["cluster=kubernetes", "cluster.gpu=2", "cluster.nodes=1", "cluster.procs_per_node=2", "train.tp=2"]
    assert compose([*gpus, "train.async_tp=true"]).train.async_tp


@pytest.mark.parametrize(
    "override,message",
    [
        ("train.lr=inf", "train.lr: must be a finite number > 0, got inf"),
        ("train.log_interval=0", "train.log_interval: must be >= 1, got 0"),
        ("train.lr=nan", "train.lr: must be a finite number > 0, got nan"),
        ("train.grad_clip=inf", "train.grad_clip: must be a finite number >= 0 (0 disables), got inf"),
        ("train.checkpoint_interval=0", "train.checkpoint_interval: must be >= 1, got 0"),
        ("train.straggler_interval=-5", "train.straggler_interval: must be >= 1, got -5"),
        ("train.beta2=1.0", "train.beta2: must be in [0, 1), got 1.0"),
        ("train.watchdog_timeout_s=0", "train.watchdog_timeout_s: must be > 0, got 0.0"),
        ("model.hidden_size=0", "model.hidden_size: must be >= 1, got 0"),
        ("data.cache_gb=-inf", "data.cache_gb: must be a finite number > 0, got -inf"),
        (
            "preflight.allreduce_sizes_mb=[1,nan]",
            "preflight.allreduce_sizes_mb[1]: must be a finite number > 0, got nan",
        ),
        (
            "cluster.volumes=[{name:a,mount_path:/x},{name:b,mount_path:/x/}]",
            "cluster.volumes: mount paths must be unique and not /dev/shm, got ['/x', '/x']",
        ),
        ("+cluster.env={NODE_NAME:n1}", "cluster.env: NODE_NAME set by liftoff itself: not configurable"),
        ("+cluster.extra_resources={rdma/ib:0}", "cluster.extra_resources.rdma/ib: must be >= 1, got 0"),
        (
            "+preflight.floors.gemm_tflops=5",
            "preflight.floors: gemm_tflops: not a metric preflight measures (names start with gemm_tflops_, "
            "membw_gbps, allreduce_busbw_gbps, storage_read_mbps, storage_roundtrip_mbps)",
        ),
    ],
)
def test_values_that_cannot_work_fail_at_compose_naming_the_key(override, message, capsys):
    with pytest.raises(ConfigError) as err:
        compose([override])
    assert str(err.value) == f"invalid config:\n  {message}"
    assert main(["config", override]) == 2
    captured = capsys.readouterr()
    assert captured.out == "" and captured.err == f"liftoff config: invalid config: {message}\n"


@pytest.mark.parametrize(
    "overrides,message",
    [
        (["train.tp=3", "cluster.nodes=2"], "train.tp: 3 must divide the world size 2"),
        (["train.tp=2", "cluster.nodes=4"], "train.tp: 2 with train.parallelism=ddp needs the world size 4 to be 2"),
        (["train.tp=8", "cluster.nodes=8", "train.parallelism=fsdp"], "train.tp: 8 must divide model.num_heads=4"),
        (["train.tp=2", "cluster.nodes=4", "train.parallelism=fsdp", "train.dp_replicate=2"],
         "train.dp_replicate: 2 must divide the data-parallel world 2 (cluster.nodes x procs_per_node / train.tp)"),
        (["train.tp=0"], "train.tp: must be >= 1 (1: no tensor parallelism), got 0"),
        (["train.tp=2", "cluster.nodes=2", "train.precision=fp8", "train.fp8_recipe=rowwise"],
         "train.tp: 2 with fp8 needs train.fp8_recipe=tensorwise (torchao's float8 TP styles), got rowwise"),
    ],
)  # fmt: skip
def test_tensor_parallel_degrees_that_cannot_split_the_world_or_the_model_fail_at_compose(overrides, message):
    with pytest.raises(ConfigError) as err:
        compose(overrides)
    assert message in str(err.value)
    compose(["train.tp=2", "cluster.nodes=4", "train.parallelism=fsdp"])  # TP=2 x FSDP=2 composes


PP = ["train.pp=2", "train.grad_accum_steps=2"]


@pytest.mark.parametrize(
    "overrides,message",
    [
        (["train.pp=2", "cluster.nodes=2", "train.micro_batch_size=3"],
         "train.grad_accum_steps: 1 micro-batches of 3 cannot fill 2 pipeline stages"),
        ([*PP, "cluster.nodes=3"], "train.pp: 2 must divide the world size 3"),
        ([*PP, "cluster.nodes=4"], "train.pp: 2 with train.parallelism=ddp needs the world size 4 to be 2"),
        ([*PP, "cluster.nodes=2", "train.pp_schedule=interleaved_1f1b"],
         "train.pp: 2 x 2 stage(s) per rank (interleaved_1f1b) need model.num_layers >= 4, got 2"),
        ([*PP, "cluster.nodes=2", "model.tie_embeddings=true"], "train.pp: 2 needs model.tie_embeddings=false"),
        ([*PP, "cluster.nodes=6", "train.tp=2", "train.parallelism=fsdp"],
         "train.pp: 2 x train.tp=2 must divide the world size 6"),
        ([*PP, "cluster.nodes=8", "train.tp=2"],
         "train.pp: 2 with train.parallelism=ddp needs the world size 8 to be 4"),
        ([*PP, "cluster.nodes=2", "train.loss_scaling=true"], "train.pp: 2 with train.loss_scaling"),
        (["train.pp=2", "train.grad_accum_steps=5", "cluster.nodes=2", "train.pp_schedule=interleaved_1f1b",
          "model.num_layers=4"],
         "train.grad_accum_steps: 5 pipeline micro-batches are not a multiple of the interleaved schedule's 2 rounds"),
        ([*PP, "cluster.nodes=4", "train.parallelism=fsdp", "train.dp_replicate=2"],
         "train.dp_replicate: 2 must divide the data-parallel world 2 (cluster.nodes x procs_per_node / train.pp)"),
        (["train.pp_schedule=zero_bubble"], "train.pp_schedule: 'zero_bubble': one of 1f1b, gpipe, interleaved_1f1b"),
        (["train.pp=0"], "train.pp: must be >= 1 (1: no pipeline parallelism), got 0"),
    ],
)  # fmt: skip
def test_pipeline_degrees_that_cannot_fill_the_stages_fail_at_compose(overrides, message):
    with pytest.raises(ConfigError) as err:
        compose(overrides)
    assert message in str(err.value)
    compose([*PP, "cluster.nodes=4", "train.parallelism=fsdp"])  # PP=2 x FSDP=2 composes
    # PP=2 x TP=2 composes as it is asked for: one step's 8 sequences split into 2 pipeline micro-batches
    cfg = compose(["train.tp=2", "train.pp=2", "cluster.nodes=2", "cluster.procs_per_node=2"])
    assert pipeline_microbatches(cfg.train) == (2, 4)
    assert ParallelDims.of(cfg.train, 4) == ParallelDims(dp_replicate=1, dp_shard=1, tp=2, pp=2)


@pytest.mark.parametrize(
    "override,message",
    [
        ("train.lr=inf", "train.lr: must be a finite number > 0, got inf"),
        ("train.log_interval=0", "train.log_interval: must be >= 1, got 0"),
    ],
)
def test_the_liftoff_command_refuses_them_in_one_line(override, message):
    from tests.helpers import cli

    proc = cli("config", override)
    assert proc.returncode == 2 and proc.stdout == ""
    assert proc.stderr == f"liftoff config: invalid config: {message}\n"


def test_a_range_error_skips_the_rules_that_read_that_group():
    """`model.num_heads=0` is one error, not also a divisibility rule dividing by it; a bad
    group does not stop another group's rules."""
    with pytest.raises(ConfigError) as err:
        compose(["model.num_heads=0", "train.warmup_steps=5000"])
    assert str(err.value).splitlines()[1:] == [
        "  model.num_heads: must be >= 1, got 0",
        "  train.warmup_steps: 5000 must be >= 0 and < train.steps=60",
    ]


def test_every_numeric_key_has_a_range_decided():
    """A new int or float field must get a BOUNDS entry (or a NOT_BOUNDED reason); every entry
    names a real key."""
    import dataclasses
    import typing

    from components.config import BOUNDS, NOT_BOUNDED, Config

    def numeric(hint) -> bool:
        return hint in (int, float) or any(numeric(a) for a in typing.get_args(hint) if a is not str)

    keys = set()
    for group in dataclasses.fields(Config):
        schema = typing.get_type_hints(Config)[group.name]
        for f, hint in typing.get_type_hints(schema).items():
            if numeric(hint) and hint is not bool:
                keys.add(f"{group.name}.{f}")
    assert keys - set(BOUNDS) - set(NOT_BOUNDED) == set()
    assert set(BOUNDS) | set(NOT_BOUNDED) <= keys


def test_every_option_in_conf_composes():
    """Every YAML file of every group, and each model on the cluster, passes the ranges (the
    hub presets need the pin their comment asks for)."""
    from components.config import config_groups

    pins = {"data": "data.hub_revision=" + "0" * 40, "tokenizer": "tokenizer.revision=" + "0" * 40}
    for group, options in config_groups().items():
        for option in options:
            compose([f"{group}={option}", *([pins[group]] if group in pins else [])])
    for model in config_groups()["model"]:
        compose([f"model={model}", "cluster=kubernetes", "store=minio", "~experiment"])


def test_one_composition_gives_the_config_and_hydras_choices():
    """compose_choices: the config compose() gives and the option each group took, a preset's
    own choices included; a removed group has none."""
    from omegaconf import OmegaConf

    from components.config import compose_choices

    cfg, choices = compose_choices(["experiment=h200-7b", "train.steps=5000"])
    assert OmegaConf.to_yaml(cfg) == OmegaConf.to_yaml(compose(["experiment=h200-7b", "train.steps=5000"]))
    assert "hydra" not in cfg and cfg.train.steps == 5000
    assert choices["experiment"] == "h200-7b" and choices["model"] == "7b" and choices["cluster"] == "kubernetes"
    assert choices["hydra/sweeper"] == "basic"
    _, choices = compose_choices(["~experiment", "model=1b"])
    assert "experiment" not in choices and choices["model"] == "1b"
    with pytest.raises(ConfigError, match="did you mean train.lr"):
        compose_choices(["train.lrr=1"])


def test_a_run_folder_is_named_after_the_experiment_hydra_chose(tmp_path, monkeypatch):
    """Given the choices, new_run_folder composes nothing; without them, it composes once."""
    import pipelines.local as local
    from components.config import compose_choices

    cfg, choices = compose_choices([f"train.run_dir={tmp_path}"])
    monkeypatch.setattr(local, "compose_choices", lambda overrides: pytest.fail("composed again"))
    folder = local.new_run_folder(cfg, ["train.steps=5"], choices={**choices, "experiment": "h200-7b"})
    assert folder.parent == tmp_path / "h200-7b" and folder.name.endswith("_steps=5")
    assert (folder / ".hydra" / "config.yaml").is_file()
    monkeypatch.setattr(local, "compose_choices", compose_choices)
    assert local.new_run_folder(cfg, ["~experiment"]).parent == tmp_path / "default"
    assert local.new_run_folder(cfg, []).parent == tmp_path / "tiny"
