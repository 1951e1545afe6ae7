"""The pretraining DAG: tokenize -> preflight -> train -> validate -> evaluate.

One dict parameter per config group; each stage receives only the groups it depends on,
so KFP's cache skips every stage whose inputs did not change (preflight is never cached:
the fleet may have changed since the last run).
"""

from kfp import dsl, kubernetes

# Aliased: the pipeline's parameters are named after the config groups (train, preflight, eval).
from components.evaluate.component import evaluate as evaluate_op
from components.preflight.component import preflight as preflight_op
from components.tokenize.component import tokenize as tokenize_op
from components.train.component import train as train_op
from components.validate.component import validate as validate_op

MINIO_SECRET = "liftoff-minio"  # deploy/minio-secret.yaml: keys accesskey / secretkey / endpoint
PIPELINE_NAME = "liftoff-pretrain"


def on_cluster(task: dsl.PipelineTask, node_selector: dict[str, str]) -> dsl.PipelineTask:
    """What every task needs on Kubeflow: store credentials from a Secret (never a parameter),
    a RAM-backed /dev/shm for data loaders and gloo/NCCL, placement, and the pull policy."""
    kubernetes.use_secret_as_env(
        task,
        secret_name=MINIO_SECRET,
        secret_key_to_env={
            "accesskey": "MINIO_ACCESS_KEY",
            "secretkey": "MINIO_SECRET_KEY",
            "endpoint": "MINIO_ENDPOINT",
        },
    )
    kubernetes.empty_dir_mount(task, volume_name="dshm", mount_path="/dev/shm", medium="Memory")
    for key, value in node_selector.items():
        kubernetes.add_node_selector(task, label_key=key, label_value=value)
    kubernetes.add_toleration(task, key="nvidia.com/gpu", operator="Exists", effect="NoSchedule")
    kubernetes.set_image_pull_policy(task, "IfNotPresent")
    return task


def build_pipeline(node_selector: "dict[str, str] | None" = None):
    placement = dict(node_selector or {})

    @dsl.pipeline(name=PIPELINE_NAME, description="LLM pretraining: tokenize, preflight, train, validate, evaluate")
    def pretrain(
        data: dict, tokenizer: dict, model: dict, train: dict, preflight: dict, eval: dict, cluster: dict, store: dict
    ) -> str:
        tokenized = on_cluster(tokenize_op(data=data, tokenizer=tokenizer, model=model, store=store), placement)
        dataset = tokenized.outputs["dataset"]
        checked = on_cluster(
            preflight_op(dataset=dataset, model=model, train=train, cluster=cluster, preflight=preflight, store=store),
            placement,
        )
        checked.set_caching_options(False)
        trained = on_cluster(
            train_op(dataset=dataset, model=model, train=train, cluster=cluster, store=store), placement
        ).after(checked)
        validated = on_cluster(
            validate_op(trained_model=trained.outputs["trained_model"], eval=eval, store=store), placement
        )
        evaluated = on_cluster(evaluate_op(model_ref=validated.outputs["Output"], eval=eval, store=store), placement)
        return evaluated.outputs["Output"]

    return pretrain


pretrain = build_pipeline()
