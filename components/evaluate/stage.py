"""The evaluate stage: measure a validated model on the val split and publish the results."""

from __future__ import annotations

import hashlib
import json
import logging
import math
import tempfile
from dataclasses import asdict, dataclass
from datetime import datetime, timezone
from pathlib import Path

from components.blocks import load_tokenizer
from components.config import ClusterConfig, EvalConfig, StoreConfig
from components.evaluate.metrics import (
    greedy_samples,
    mixture_metrics,
    perplexity,
    token_byte_lengths,
    unigram_perplexity,
)
from components.evaluate.report import identity_rows, report_html
from components.hf import load_hf_model
from components.mixture import source_blocks, source_refs, trained_weights
from components.sharded_model import checkpoint_of, dataset_of, export_head, in_pod, launch_replicas
from components.store import ArtifactStore, Manifest, Ref
from components.stream import open_split

log = logging.getLogger(__name__)
UNIGRAM_CACHE_GB = 2.0  # the baseline's train counts read the first shards only: bound what they keep


class EvalInputError(ValueError):
    pass


@dataclass
class EvalResult:
    metrics: dict[str, float]
    samples: list[dict]
    html: str
    manifest: Manifest
    report_path: Path  # the published report.html, fetched: a file a browser opens


def measure(
    model_dir: Path, store: ArtifactStore, data: Manifest, cfg: EvalConfig, weights: dict | None = None
) -> tuple[dict[str, float], list[dict]]:
    """Metrics and samples of one model on the dataset's val split (its shards from the store;
    the unigram baseline counts the first train blocks, never the whole train split). A
    mixture's corpus: on each source's own val split (its first eval.val_blocks), and the
    mixture's figures from them by `weights` (the model's; by default the val splits' sizes)."""
    model = load_hf_model(model_dir)
    tokenizer = load_tokenizer(store.fetch(data))
    val = open_split(store, data, "val")
    if len(val) == 0:
        raise EvalInputError(f"{data.ref}: the val split has zero blocks; nothing to evaluate")
    vocab = model.config.vocab_size
    lengths = token_byte_lengths(tokenizer, vocab)
    if sources := source_refs(data):
        per = {}
        for name, ref in sources.items():
            own = open_split(store, store.manifest(Ref.parse(ref)), "val")
            per[name] = perplexity(model, own, cfg.val_blocks, cfg.batch_size, lengths)
            own.close()
        metrics = mixture_metrics(per, weights or source_blocks(data, "val"))
    else:
        metrics = perplexity(model, val, cfg.val_blocks, cfg.batch_size, lengths)
    train = open_split(store, data, "train", cache_gb=UNIGRAM_CACHE_GB)
    metrics["unigram_perplexity"] = unigram_perplexity(train, val, cfg.val_blocks, vocab)
    val.close()
    train.close()
    metrics["perplexity_vs_unigram"] = metrics["val_perplexity"] / metrics["unigram_perplexity"]
    metrics.update(run_lm_eval(model_dir, cfg.lm_eval_tasks))
    return metrics, greedy_samples(model, tokenizer, cfg.prompts, cfg.max_new_tokens)


def check_lm_eval_tasks(tasks: list[str]) -> None:
    """Fail before any evaluation when a configured lm-eval task does not exist."""
    if not tasks:
        return
    try:
        from lm_eval.tasks import TaskManager
    except ImportError:
        raise EvalInputError("eval.lm_eval_tasks needs the lm-eval package (pip install 'liftoff[lm-eval]')") from None
    known = set(TaskManager().all_tasks)
    unknown = [t for t in tasks if t not in known]
    if unknown:
        raise EvalInputError(f"eval.lm_eval_tasks: unknown lm-eval task(s) {unknown}")


def run_lm_eval(model_dir: Path, tasks: list[str]) -> dict[str, float]:
    """Optional lm-eval-harness tasks on the local model (tasks that download data need a cluster)."""
    if not tasks:
        return {}
    import lm_eval

    results = lm_eval.simple_evaluate(model="hf", model_args=f"pretrained={model_dir}", tasks=list(tasks))
    out = {}
    for task, values in results["results"].items():
        for key, value in values.items():
            if isinstance(value, (int, float)):
                out[f"lm_eval/{task}/{key.replace(',', '/')}"] = float(value)
    return out


def measure_on_replicas(
    model_ref: str, cfg: EvalConfig, cluster: ClusterConfig | None, store_cfg: StoreConfig | None, store: ArtifactStore
) -> tuple[dict, list, dict | None]:
    """measure(), the model sharded over the cluster's nodes (components/evaluate/worker.py):
    (metrics, samples, the baseline's metrics or None)."""
    if cfg.lm_eval_tasks:
        raise EvalInputError(
            f"{model_ref} does not fit the evaluate pod (eval.launch={cfg.launch}): lm-eval loads the whole model "
            f"in one process; leave eval.lm_eval_tasks empty or raise kfp.eval_memory_gb"
        )
    if cluster is None or store_cfg is None:
        raise ValueError("evaluate on replicas needs the cluster and store groups")
    models = [model_ref]
    if cfg.baseline:
        baseline = store.manifest(Ref.parse(cfg.baseline))
        if checkpoint_of(baseline) is None:
            raise EvalInputError(
                f"eval.baseline {cfg.baseline}: its lineage names no checkpoint, and on replicas a model is "
                "loaded from its checkpoint's weights"
            )
        models.append(str(baseline.ref))
    measured = launch_replicas("components.evaluate.worker", "evaluate", cfg, models, cluster, store_cfg, store)
    if "failed" in measured:
        raise EvalInputError(measured["failed"])
    first = measured["measured"][0]
    return first["metrics"], first["samples"], measured["measured"][1]["metrics"] if cfg.baseline else None


def eval_suffix(cfg: EvalConfig) -> str:
    """What an eval version adds to its model's: the hash of how it measured (the objective a
    sweep reads and where the model was loaded are not part of the measurement)."""
    measured = {k: v for k, v in asdict(cfg).items() if k not in ("objective", "launch")}
    return hashlib.sha256(json.dumps(measured).encode()).hexdigest()[:8]


def run_evaluate(model_ref: str, cfg: EvalConfig, store: ArtifactStore, cluster: ClusterConfig | None = None,
                 store_cfg: StoreConfig | None = None, pod_memory_gb: float = math.inf) -> EvalResult:  # fmt: skip
    """In this pod, or on launched replicas when the model does not fit it (`eval.launch`)."""
    check_lm_eval_tasks(cfg.lm_eval_tasks)
    model_manifest = store.manifest(Ref.parse(model_ref))
    data_ref = dataset_of(model_manifest)
    if data_ref is None:
        raise EvalInputError(f"{model_ref}: its lineage names no dataset")
    data = store.manifest(Ref.parse(data_ref))
    if in_pod(cfg, model_manifest, pod_memory_gb):
        model_dir = store.fetch(model_manifest)
        weights = trained_weights(model_manifest)
        metrics, samples = measure(model_dir, store, data, cfg, weights)
        base = None
        if cfg.baseline:
            base = measure(store.fetch(store.manifest(Ref.parse(cfg.baseline))), store, data, cfg, weights)[0]
    else:
        metrics, samples, base = measure_on_replicas(model_ref, cfg, cluster, store_cfg, store)
        model_dir = export_head(store, model_manifest)  # its config and training curves: no weights
    deltas = None
    if base is not None:
        deltas = {k: metrics[k] - base[k] for k in metrics if k in base}
        metrics.update({f"baseline_{k}": v for k, v in base.items()})
    version = f"{model_manifest.ref.version}-{eval_suffix(cfg)}"
    evaluated = datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M:%S UTC")
    eval_ref = f"eval/{model_manifest.ref.name}@{version}"
    identity = identity_rows(model_manifest, data_ref, model_dir, evaluated, eval_ref)
    if cfg.baseline:
        identity["baseline"] = cfg.baseline
    page = report_html(metrics, samples, model_dir / "training_metrics.jsonl", deltas, identity)
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp)
        (out / "metrics.json").write_text(json.dumps(metrics, indent=2))
        (out / "samples.json").write_text(json.dumps(samples, indent=2))
        (out / "report.html").write_text(page)
        manifest = store.publish(
            "eval",
            model_manifest.ref.name,
            version,
            out,
            metadata={"metrics": metrics},
            parents=[str(model_manifest.ref), data_ref],
        )
    log.info(
        "evaluation of %s: perplexity %.2f (unigram %.2f), %.3f bits/byte",
        model_ref,
        metrics["val_perplexity"],
        metrics["unigram_perplexity"],
        metrics["val_bits_per_byte"],
    )
    report_path = store.fetch(manifest) / "report.html"
    log.info("evaluation report: %s", report_path)
    return EvalResult(metrics, samples, report_path.read_text(), manifest, report_path)
