"""The pretraining DAG: tokenize (plan -> one task per shard -> merge) -> preflight -> train
-> validate -> evaluate.

One dict parameter per config group; each stage receives only the groups it depends on,
so KFP's cache skips every stage whose inputs did not change. Preflight is never cached
(the fleet may have changed since the last run), so train, which takes its verdict, reruns
too: with the same training identity it resumes from its final checkpoint and re-exports.
Every edge is an artifact: the dataset, preflight's verdict (train refuses to start without
a passing one), the trained model and the validated model, so the Kubeflow UI's graph shows
the whole lineage.
"""

from typing import Any

from kfp import dsl, kubernetes

# Aliased: the pipeline's parameters are named after the config groups (train, preflight, eval).
from components.evaluate.component import evaluate as evaluate_op
from components.k8s import STORE_SECRET_KEYS
from components.preflight.component import preflight as preflight_op
from components.tokenize.component import tokenize_merge, tokenize_plan, tokenize_shard
from components.train.component import train as train_op
from components.validate.component import validate as validate_op


def on_cluster(
    task: dsl.PipelineTask, cfg: Any, memory_gb: float | None = None, retry: bool = True
) -> dsl.PipelineTask:
    """What every task needs on Kubeflow: the stage image, its pull policy and pull secrets,
    store credentials from a Secret (never a parameter), a RAM-backed /dev/shm, resource
    requests (a BestEffort pod is the first evicted) and retries (an evicted or lost driver
    pod reruns; train resumes from the store and deletes its orphaned job first). No retries
    for the two tasks that check every group and the inputs (the tokenize plan, preflight): a
    deterministic failure, or a failed gate, stops the run at once; nor with the local scheduler,
    where a failed task is the code's, not a lost pod's (kfp.local honours retries too)."""
    task.set_container_image(cfg.cluster.image)
    kubernetes.set_image_pull_policy(task, cfg.cluster.image_pull_policy)
    if cfg.cluster.image_pull_secrets:
        kubernetes.set_image_pull_secrets(task, list(cfg.cluster.image_pull_secrets))
    task.set_cpu_request(f"{cfg.kfp.task_cpu:g}")
    task.set_memory_request(f"{memory_gb or cfg.kfp.task_memory_gb:g}G")
    if retry and cfg.kfp.task_retries and cfg.cluster.scheduler == "kubernetes":
        task.set_retry(cfg.kfp.task_retries, backoff_duration="30s", backoff_factor=2.0, backoff_max_duration="600s")
    kubernetes.use_secret_as_env(
        task,
        secret_name=cfg.store.secret_name,
        secret_key_to_env={key: env for env, key in STORE_SECRET_KEYS.items()},
    )
    kubernetes.empty_dir_mount(task, volume_name="dshm", mount_path="/dev/shm", medium="Memory")
    return task  # no GPU placement: these pods drive TorchX jobs; the replicas get the GPUs


def build_pipeline(cfg: Any):
    """The pipeline for a composed config (image, pull policy, Secret, name and placement come
    from it; the groups become the parameters' defaults when it is compiled)."""

    @dsl.pipeline(
        name=cfg.kfp.pipeline_name, description="LLM pretraining: tokenize, preflight, train, validate, evaluate"
    )
    def pretrain(
        data: dict, tokenizer: dict, model: dict, train: dict, preflight: dict, eval: dict, cluster: dict, store: dict
    ) -> str:
        # not retried: its failures are the config's or the source's (a bad group value edited in the
        # UI, a path that is not there), never worth a second attempt; what it costs an evicted pod
        # is a rerun of the plan (the shards it made are in the store)
        planned = on_cluster(tokenize_plan(data=data, tokenizer=tokenizer, model=model, store=store), cfg, retry=False)
        planned.set_caching_options(False)  # the same config may name changed bytes: the plan hashes them
        with dsl.ParallelFor(planned.outputs["Output"], parallelism=cfg.data.parallelism) as shard:
            sharded = on_cluster(tokenize_shard(shard=shard, store=store), cfg)
        merged = on_cluster(
            tokenize_merge(
                shards=dsl.Collected(sharded.output),
                plan=planned.outputs["plan"],
                data=data,
                tokenizer=tokenizer,
                store=store,
            ),
            cfg,
        )
        dataset = merged.outputs["dataset"]
        checked = on_cluster(
            preflight_op(
                dataset=dataset,
                data=data,
                model=model,
                train=train,
                eval=eval,
                cluster=cluster,
                preflight=preflight,
                store=store,
            ),
            cfg,
            retry=False,
        )
        checked.set_caching_options(False)
        trained = on_cluster(
            train_op(
                dataset=dataset,
                preflight_verdict=checked.outputs["verdict"],
                data=data,
                model=model,
                train=train,
                cluster=cluster,
                store=store,
            ),
            cfg,
        )
        validated = on_cluster(
            validate_op(
                trained_model=trained.outputs["trained_model"],
                eval=eval,
                cluster=cluster,
                store=store,
                pod_memory_gb=cfg.kfp.eval_memory_gb,  # its pod's memory request: a bigger model goes to the nodes
            ),
            cfg,
            cfg.kfp.eval_memory_gb,
        )
        evaluated = on_cluster(
            evaluate_op(
                validated_model=validated.outputs["validated_model"],
                eval=eval,
                cluster=cluster,
                store=store,
                pod_memory_gb=cfg.kfp.eval_memory_gb,
            ),
            cfg,
            cfg.kfp.eval_memory_gb,
        )
        return evaluated.outputs["Output"]

    return pretrain
