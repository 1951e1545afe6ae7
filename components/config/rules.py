"""What values can work: each group's rules between its keys, the rules that read a second
group, and `BOUNDS`, the range of every numeric key in one table. `check_config` runs them all.

Types are the schema's (checked by OmegaConf when Hydra composes); a rule judges values that
are typed right, and its message names the key it judges.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from omegaconf import DictConfig, OmegaConf

from components.config.bounds import PIPELINE_SCHEDULES, out_of_bounds
from components.parallel import data_parallel, pipeline_microbatches

if TYPE_CHECKING:
    from components.config.schema import (
        ClusterConfig,
        Config,
        DataConfig,
        EvalConfig,
        KfpConfig,
        ModelConfig,
        PreflightConfig,
        StoreConfig,
        TokenizerConfig,
        TrainConfig,
        VolumeConfig,
    )

PULL_POLICIES = ("Always", "IfNotPresent", "Never")
VOLUME_KINDS = ("emptyDir", "hostPath", "pvc")
RESERVED_ENV = (
    *("MINIO_ACCESS_KEY", "MINIO_SECRET_KEY", "MINIO_ENDPOINT", "NODE_NAME", "OMP_NUM_THREADS"),
    *("LOGLEVEL", "PYTHONWARNINGS", "PYTHONPATH", "PATH"),
)
# what preflight measures per node that a floor may hold (the leave-one-out z-score too);
# `gemm_tflops_<dtype>`, `allreduce_busbw_gbps_<size>mb` or `allreduce_busbw_gbps` (its largest size)
PERF_METRICS = ("gemm_tflops_", "membw_gbps", "allreduce_busbw_gbps", "storage_read_mbps", "storage_roundtrip_mbps")
# what the evaluate stage records in its artifact's metrics (components/evaluate/stage.py)
EVAL_METRICS = ("val_loss", "val_perplexity", "val_bits_per_byte", "unigram_perplexity", "perplexity_vs_unigram",
                "inference_tokens_per_s", "val_tokens")  # fmt: skip


class ConfigError(ValueError):
    """A config value that is well-typed but cannot work; the message names the key."""


def failed(rules: list[tuple[str, bool, str]]) -> list[str]:
    """`key: message` for each (key, holds, message) rule that does not hold; a message that
    already names its key with a value (`model.hidden_size=64 is not ...`) stands alone."""
    return [message if f"{key}=" in message else f"{key}: {message}" for key, holds, message in rules if not holds]


def is_commit(revision: str | None) -> bool:
    """A hub revision that cannot move: a full commit sha, not a branch or a tag."""
    return bool(revision) and re.fullmatch(r"[0-9a-f]{40}", revision) is not None


def from_hub(tok: TokenizerConfig) -> bool:
    """tokenizer.pretrained names a hub repo, not a local directory (absolute, ./ or ~ paths)."""
    return bool(tok.pretrained) and not tok.pretrained.startswith(("/", ".", "~"))


def data_rules(data: DataConfig, model: ModelConfig | None = None) -> list[str]:
    rules = [*mixture_rules(data)]
    for name in data.source_names:
        src = data.source(name) if name in data.sources or not data.sources else None
        if src is None:
            continue
        key = f"data.sources.{name}" if data.sources else "data"
        pinned = not src.hub_name or bool(src.paths) or is_commit(src.hub_revision)
        rules += [
            (f"{key}.paths", bool(src.paths) or bool(src.hub_name), "give data.paths or data.hub_name"),
            (
                f"{key}.hub_revision",
                pinned,
                f"pin {key}.hub_name={src.hub_name} to a commit of the hub repo, its 40-hex sha (a branch or tag "
                f"moves), got {src.hub_revision}",
            ),
        ]
    if model is not None:  # blocks longer than the model's positions cannot train
        ok = data.seq_len <= model.max_seq_len
        rules.append(("data.seq_len", ok, f"{data.seq_len} exceeds model.max_seq_len={model.max_seq_len}"))
    return failed(rules)


def mixture_rules(data: DataConfig) -> list[tuple[str, bool, str]]:
    """data.mixture names known sources with weights >= 0 that do not sum to 0."""
    known = data.source_names
    unknown = sorted(set(data.mixture) - set(known))
    negative = {s: w for s, w in data.mixture.items() if w < 0}
    capped = {s: c.max_epochs for s, c in data.sources.items() if c.max_epochs is not None and c.max_epochs <= 0}
    fractions = {s: c.val_fraction for s, c in data.sources.items() if c.val_fraction is not None}
    few = {s: c.shards for s, c in data.sources.items() if c.shards is not None and c.shards < 1}
    short = {s: c.min_chars for s, c in data.sources.items() if c.min_chars is not None and c.min_chars < 1}
    return [
        ("data.mixture", not unknown, f"{', '.join(unknown)} not among the sources ({', '.join(known)})"),
        ("data.mixture", not negative, f"weights must be >= 0, got {negative}"),
        (
            "data.mixture",
            not data.mixture or negative or sum(data.mixture.values()) > 0,
            f"the weights sum to 0 ({dict(data.mixture)}): give at least one source a weight above 0",
        ),
        ("data.sources", data.name not in data.sources, f"a source is named data.name={data.name}: rename one"),
        ("data.sources", "all" not in data.sources, "a source is named all, which Prometheus's source=all means"),
        ("data.sources", not capped, f"max_epochs must be > 0, got {capped}"),
        (
            "data.sources",
            all(0 < f < 1 for f in fractions.values()),
            f"val_fraction must be in (0, 1), got {fractions}",
        ),
        ("data.sources", not short, f"min_chars must be >= 1, got {short}"),
        ("data.sources", not few, f"shards must be >= 1, got {few}"),
    ]


def tokenizer_rules(tok: TokenizerConfig) -> list[str]:
    pinned = not from_hub(tok) or is_commit(tok.revision)
    why = (
        f"pin tokenizer.pretrained={tok.pretrained} to a commit of the hub repo, its 40-hex sha "
        f"(a branch or tag moves), got {tok.revision}"
    )
    return failed([("tokenizer.revision", pinned, why)])


def model_rules(model: ModelConfig) -> list[str]:
    heads, kv = model.num_heads, model.num_kv_heads
    if heads < 1 or kv < 1:
        return []  # out of BOUNDS, which problems() reports (and then skips these rules)
    return failed([
        ("model.hidden_size", model.hidden_size % heads == 0,
         f"model.hidden_size={model.hidden_size} is not divisible by model.num_heads={heads}"),
        ("model.num_kv_heads", heads % kv == 0,
         f"model.num_heads={heads} is not divisible by model.num_kv_heads={kv} "
         "(each kv head serves a whole group of query heads)"),
        ("model.head_dim", (model.hidden_size // heads) % 2 == 0,
         "hidden_size / num_heads must be even for rotary embeddings"),
        *family_rules(model),
    ])  # fmt: skip


FAMILY_NAMES = ("llama", "moe")  # components/models/FAMILIES (tests/test_layout.py holds the two alike)


def family_rules(model: ModelConfig) -> list:
    moe = model.family == "moe"
    k, e = model.experts_per_token, model.num_experts
    return [
        ("model.family", model.family in FAMILY_NAMES, f"{model.family!r}: one of {', '.join(FAMILY_NAMES)}"),
        (
            "model.num_experts",
            (e >= 2) if moe else e == 0,
            f"{e}: model.family=moe needs 2 or more experts" if moe else f"{e}: only model.family=moe has experts",
        ),
        (
            "model.experts_per_token",
            (1 <= k <= e) if moe else k == 0,
            f"{k} must be in [1, model.num_experts={e}]" if moe else f"{k}: only model.family=moe routes to experts",
        ),
    ]


def train_rules(train: TrainConfig, cluster: ClusterConfig | None = None, model: ModelConfig | None = None):
    rules = [
        ("train.warmup_steps", 0 <= train.warmup_steps < train.steps,
         f"{train.warmup_steps} must be >= 0 and < train.steps={train.steps}"),
        ("train.min_lr", 0 <= train.min_lr <= train.lr, f"{train.min_lr} must be in [0, train.lr={train.lr}]"),
        ("train.resume", bool(train.resume.strip()), "must be auto, never or a checkpoint version"),
    ]  # fmt: skip
    r, tp = train.dp_replicate, train.tp
    world = cluster.nodes * cluster.procs_per_node if cluster is not None else None
    if r > 1:  # HSDP: r groups, each sharding over world / (r x tp) ranks
        why = f"{r} replicas need train.parallelism=fsdp (HSDP), got {getattr(train.parallelism, 'value', '')}"
        rules.append(("train.dp_replicate", train.parallelism == "fsdp", why))
        if world is not None:
            split = tp * train.pp
            dp = data_parallel(world, tp, train.pp) if world % split == 0 else world
            over = (" / train.tp" if tp > 1 else "") + (" / train.pp" if train.pp > 1 else "")
            why = f"{r} must divide the data-parallel world {dp} (cluster.nodes x procs_per_node{over})"
            why += " into groups of 2+ ranks"
            rules.append(("train.dp_replicate", dp % r == 0 and dp > r, why))
    if tp > 1 and world is not None:
        why = f"{tp} must divide the world size {world} (cluster.nodes x procs_per_node)"
        rules.append(("train.tp", world % tp == 0, why))
        whole = tp * train.pp
        why = (f"{tp} with train.parallelism=ddp needs the world size {world} to be {whole} (DDP does not replicate "
               "tensor-parallel DTensors): use train.parallelism=fsdp to add data parallelism")  # fmt: skip
        rules.append(("train.tp", train.parallelism != "ddp" or world % whole or world == whole, why))
    if train.async_tp:  # inductor's micro-pipeline TP pass, over CUDA symmetric memory
        rules.append(("train.async_tp", tp > 1, f"needs train.tp > 1 (tensor parallelism to overlap), got {tp}"))
        rules.append(("train.async_tp", train.compile is not False,
                      "needs train.compile (inductor's micro-pipeline pass rewrites the compiled blocks)"))  # fmt: skip
        if cluster is not None:
            why = f"needs CUDA GPUs (symmetric memory), got cluster.gpu={cluster.gpu} per replica"
            rules.append(("train.async_tp", cluster.gpu > 0, why))
    if tp > 1 and train.precision == "fp8":  # torchao's float8 TP styles cast inputs tensorwise
        got = train.fp8_recipe.value
        why = f"{tp} with fp8 needs train.fp8_recipe=tensorwise (torchao's float8 TP styles), got {got}"
        rules.append(("train.tp", train.fp8_recipe == "tensorwise", why))
    known = ", ".join(PIPELINE_SCHEDULES)
    rules.append(
        ("train.pp_schedule", train.pp_schedule in PIPELINE_SCHEDULES, f"{train.pp_schedule!r}: one of {known}")
    )
    if train.pp > 1 and train.pp_schedule in PIPELINE_SCHEDULES:
        rules += pipeline_rules(train, world, model)
    if model is not None and model.family == "moe":  # experts replicated in the FSDP shard, no expert parallelism
        for key, degree in (("train.tp", tp), ("train.pp", train.pp)):
            rules.append((key, degree == 1, f"{degree}: model.family=moe trains under DDP or FSDP only (no TP or PP)"))
    if tp > 1 and model is not None:
        for key, n in (("num_heads", model.num_heads), ("num_kv_heads", model.num_kv_heads),
                       ("ffn_hidden_size", model.ffn_hidden_size)):  # fmt: skip
            rules.append(("train.tp", n % tp == 0, f"{tp} must divide model.{key}={n} (each rank holds a whole share)"))
    return failed(rules)


def pipeline_rules(train: TrainConfig, world: int | None, model: ModelConfig | None) -> list:
    pp, tp, accum, mbs = train.pp, train.tp, train.grad_accum_steps, train.micro_batch_size
    per_rank = PIPELINE_SCHEDULES[train.pp_schedule]
    rules = [
        ("train.pp", not train.loss_scaling, f"{pp} with train.loss_scaling: the schedule runs backward unscaled"),
        ("train.grad_accum_steps", accum >= pp or (mbs * accum) % pp == 0,
         f"{accum} micro-batches of {mbs} cannot fill {pp} pipeline stages (train.pp): each step needs >= {pp} "
         f"micro-batches, or micro_batch_size x grad_accum_steps = {mbs * accum} split into {pp} equal parts"),
    ]  # fmt: skip
    micro = pipeline_microbatches(train)[0]
    if per_rank > 1:
        rounds = max(1, micro // pp)
        why = f"{micro} pipeline micro-batches are not a multiple of the interleaved schedule's {rounds} rounds (// pp)"
        rules.append(("train.grad_accum_steps", micro % rounds == 0, why))
    if world is not None:
        rules.append(
            ("train.pp", world % pp == 0, f"{pp} must divide the world size {world} (cluster.nodes x procs_per_node)")
        )
        if tp > 1 and world % pp == 0 and world % tp == 0:
            why = f"{pp} x train.tp={tp} must divide the world size {world} (cluster.nodes x procs_per_node)"
            rules.append(("train.pp", world % (pp * tp) == 0, why))
        why = (
            f"{pp} with train.parallelism=ddp needs the world size {world} to be {pp * tp} (DDP breaks under "
            "a schedule's several forwards per backward): use train.parallelism=fsdp to add data parallelism"
        )
        rules.append(("train.pp", train.parallelism != "ddp" or world % (pp * tp) or world == pp * tp, why))
    if model is not None:
        stages = pp * per_rank
        rules.append(("train.pp", model.num_layers >= stages,
                      f"{pp} x {per_rank} stage(s) per rank ({train.pp_schedule}) need model.num_layers >= "
                      f"{stages}, got {model.num_layers}"))  # fmt: skip
        rules.append(
            (
                "train.pp",
                not model.tie_embeddings,
                f"{pp} needs model.tie_embeddings=false: the embeddings and the head live on two stages",
            )
        )
    return rules


OUTLIERS = (None, "quarantine", "warn")  # what a performance outlier does (null: warn on the local scheduler)


def preflight_rules(preflight: PreflightConfig, cluster: ClusterConfig | None = None) -> list[str]:
    unknown = sorted(k for k in preflight.floors if not k.startswith(PERF_METRICS))
    measured = ", ".join(PERF_METRICS)
    why = f"{', '.join(unknown)}: not a metric preflight measures (names start with {measured})"
    rules = [("preflight.floors", not unknown, why)]
    rules.append(("preflight.outliers", preflight.outliers in OUTLIERS,
                  f"must be one of quarantine, warn or null, got {preflight.outliers!r}"))  # fmt: skip
    if cluster is not None:  # the gate needs at least this many of the nodes the job asks for
        n = preflight.min_healthy_nodes
        ok = n is None or 1 <= n <= cluster.nodes
        rules.append(("preflight.min_healthy_nodes", ok, f"{n} must be in [1, cluster.nodes={cluster.nodes}]"))
    return failed(rules)


EVAL_LAUNCH = ("auto", "pod", "replicas")  # where validate and evaluate load the model


def eval_rules(ev: EvalConfig, data: DataConfig | None = None) -> list[str]:
    metric, _, source = ev.objective.partition("/")
    per_source = bool(source) and metric in ("val_loss", "val_perplexity", "val_bits_per_byte")
    if per_source and data is not None and source not in data.sources:
        names = ", ".join(data.sources) or "none: data.sources is empty"
        return [f"eval.objective={ev.objective}: {source} is not a source of the mixture ({names})"]
    known = ev.objective in EVAL_METRICS or ev.objective.startswith("lm_eval/") or per_source
    why = (
        f"{ev.objective!r} is not a metric evaluate records ({', '.join(EVAL_METRICS)}, lm_eval/..., or a "
        "mixture's val_loss/<source>, val_perplexity/<source>, val_bits_per_byte/<source>)"
    )
    return failed([
        ("eval.objective", known, why),
        ("eval.launch", ev.launch in EVAL_LAUNCH, f"must be one of {', '.join(EVAL_LAUNCH)}, got {ev.launch!r}"),
        ("eval.lm_eval_tasks", not (ev.launch == "replicas" and ev.lm_eval_tasks),
         "lm-eval loads the whole model in one process: with eval.launch=replicas, leave it empty"),
    ])  # fmt: skip


def cluster_rules(cluster: ClusterConfig) -> list[str]:
    from components.devices import DEVICES, device

    c = cluster
    known = ", ".join(d.key for d in DEVICES)
    reserved = sorted(k for k in c.env if k in RESERVED_ENV or k.startswith(("TORCHX_", "LIFTOFF_")))
    names, paths = [v.name for v in c.volumes], [v.mount_path.rstrip("/") for v in c.volumes]
    bad_env = sorted(k for k in c.env if not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", k))
    expanded = sorted(k for k, v in c.env.items() if "$(" in str(v))  # Kubernetes would expand $(VAR)
    return failed([
        ("cluster.gpu_type", c.gpu_type is None or device(c.gpu_type) is not None,
         f"unknown {c.gpu_type!r}: one of {known}, or null (then preflight.device_memory_gb "
         "and train.peak_tflops)"),
        ("cluster.image_pull_policy", c.image_pull_policy in PULL_POLICIES,
         f"must be one of {', '.join(PULL_POLICIES)}, got {c.image_pull_policy!r}"),
        ("cluster.env", not reserved, f"{', '.join(reserved)} set by liftoff itself: not configurable"),
        ("cluster.env", not bad_env, f"not an environment variable name: {', '.join(bad_env)}"),
        ("cluster.env", not expanded, f"$(...) in {', '.join(expanded)}: Kubernetes expands it; write $$(...)"),
        ("cluster.volumes", len(set(names)) == len(names) and "dshm" not in names,
         f"names must be unique and not dshm (the /dev/shm volume), got {names}"),
        ("cluster.volumes", len(set(paths)) == len(paths) and "/dev/shm" not in paths,
         f"mount paths must be unique and not /dev/shm, got {paths}"),
    ] + [rule for v in c.volumes for rule in volume_rules(v)])  # fmt: skip


def volume_rules(v: VolumeConfig) -> list[tuple[str, bool, str]]:
    key = f"cluster.volumes[{v.name}]"
    return [
        (key, bool(re.fullmatch(r"[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?", v.name)),
         "name must be a DNS label (lowercase letters, digits, '-')"),
        (key, v.kind in VOLUME_KINDS, f"kind must be one of {', '.join(VOLUME_KINDS)}, got {v.kind!r}"),
        (key, v.mount_path.startswith("/"), f"mount_path must be absolute, got {v.mount_path!r}"),
        (key, v.kind != "hostPath" or bool(v.host_path), "kind hostPath needs host_path"),
        (key, v.kind != "pvc" or bool(v.claim_name), "kind pvc needs claim_name"),
        (key, v.size_gb is None or v.size_gb > 0, f"size_gb must be > 0, got {v.size_gb}"),
        (key, v.medium in ("", "Memory"), f"medium must be '' or Memory, got {v.medium!r}"),
    ]  # fmt: skip


def store_rules(store: StoreConfig) -> list[str]:
    return []  # store.timeout_s is a range: BOUNDS


def kfp_rules(kfp: KfpConfig) -> list[str]:
    return failed([("kfp.pipeline_name", bool(kfp.pipeline_name.strip()), "must not be empty")])


# Each group's rules, and the other groups they read: a rule that reads a second group runs
# when that group is given and in range too (otherwise it gets None and skips that rule).
GROUP_RULES: dict[str, tuple[Callable[..., list[str]], tuple[str, ...]]] = {
    "data": (data_rules, ("model",)),  # data.seq_len <= model.max_seq_len
    "tokenizer": (tokenizer_rules, ()),
    "model": (model_rules, ()),
    "train": (train_rules, ("cluster", "model")),  # dp_replicate and tp divide the world; tp the heads
    "preflight": (preflight_rules, ("cluster",)),  # preflight.min_healthy_nodes <= cluster.nodes
    "eval": (eval_rules, ("data",)),  # a per-source objective names a source of data.sources
    "cluster": (cluster_rules, ()),
    "store": (store_rules, ()),
    "kfp": (kfp_rules, ()),
}


def problems(groups: dict[str, Any]) -> list[str]:
    """Every key out of its BOUNDS first; then the rules between keys of each group whose
    values are all in range (and the rules that read a second group when both are here and in
    range): a rule such as `hidden_size % num_heads` may assume sane values."""
    ranges = {name: out_of_bounds(name, group) for name, group in groups.items()}
    found = [message for messages in ranges.values() for message in messages]
    sane = {name: group for name, group in groups.items() if not ranges[name]}
    for name, group in sane.items():
        judge, reads = GROUP_RULES[name]
        found += judge(group, **{other: sane.get(other) for other in reads})
    return found


def check_config(cfg: DictConfig | Config) -> None:
    """Raise ConfigError naming every key whose value is typed right but cannot work."""
    obj = OmegaConf.to_object(cfg) if isinstance(cfg, DictConfig) else cfg
    bad = problems({f.name: getattr(obj, f.name) for f in dataclasses.fields(obj)})
    if bad:
        raise ConfigError("invalid config:\n  " + "\n  ".join(bad))
