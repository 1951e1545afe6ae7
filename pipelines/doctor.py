"""`liftoff doctor`: the live cluster and store a config names, checked before anything is submitted.

One row per check: its name, ok / warn (passes, with something to look at) / FAIL, what it found
and the fix. The replica pods are the ones `render` builds (`cluster.replica_jobs`), so the doctor
and the pods never disagree about what a replica asks for. `submit` and `upload` run every check
but the KFP one before their first call to Kubeflow Pipelines (their own backend check follows,
the same function) and refuse in one line naming the failing rows; `--skip-doctor` bypasses them.
A check that cannot reach its API is a failing row saying so.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from decimal import Decimal
from pathlib import Path

from omegaconf import DictConfig, OmegaConf

OK, WARN, FAIL = "ok", "warn", "FAIL"
KFP_SYSTEM_NAMESPACE = "kubeflow"  # where KFP's own Deployments run, whatever the profile
TIMEOUT_S = 15  # each Kubernetes API call
# what the store keeps per parameter: a checkpoint holds the fp32 weights and AdamW's two fp32
# moments (components/preflight/plan.py: 12 B/param; gradients are not saved), the model's
# export the fp32 weights (components/train/export.py)
CHECKPOINT_BYTES_PER_PARAM = 12
EXPORT_BYTES_PER_PARAM = 4
KFP_SEAWEEDFS_GIB = 20  # the volume KFP 2.16's manifests give their bundled SeaweedFS (seaweedfs-pvc)
GPU = "nvidia.com/gpu"
KUBE_FIX = (
    "point $KUBECONFIG at the cluster (the doctor gets namespaces, lists nodes and gets Volcano queues "
    "and KFP's ml-pipeline Deployment)"
)


@dataclass(frozen=True)
class Row:
    name: str
    status: str  # OK, WARN (passes) or FAIL
    found: str
    fix: str = ""

    @property
    def failed(self) -> bool:
        return self.status == FAIL


class Unhealthy(RuntimeError):
    """The doctor's refusal: one line naming every failing row and its fix."""


@dataclass
class Target:
    """What the checks look at, worked out once from the config."""

    cfg: DictConfig
    typed: object
    namespace: str  # where the replicas are created
    jobs: dict[str, dict]  # stage -> the Volcano job render builds

    def pods(self) -> dict[str, dict]:
        """stage -> its first replica's pod ({metadata, spec}): every replica of a job is alike."""
        return {stage: job["spec"]["tasks"][0]["template"] for stage, job in self.jobs.items()}


def target(cfg: DictConfig) -> Target:
    from pipelines.cluster import replica_jobs

    typed = OmegaConf.to_object(cfg)
    namespace = typed.cluster.namespace or typed.kfp.namespace or KFP_SYSTEM_NAMESPACE
    return Target(cfg, typed, namespace, replica_jobs(typed, namespace))


class Apis:
    """The Kubernetes clients, made on first use (kubeconfig loaded then: a failure is the row's)."""

    def __init__(self):
        self._made = None

    def __call__(self):
        if self._made is None:
            from kubernetes import client

            from components import k8s

            k8s.load_config()
            self._made = (client.CoreV1Api(), client.CustomObjectsApi(), client.AppsV1Api())
        return self._made


def _reason(e: BaseException) -> str:
    reason = getattr(e, "reason", None) or (str(e).splitlines() or [""])[0]
    return f"{type(e).__name__}: {reason}" if reason else type(e).__name__


def _guarded(name: str, what: str, fix: str, check: Callable[[], Row]) -> Row:
    """The check's row, or a failing row naming the API it could not reach and why (liftoff's own
    errors name the endpoint already)."""
    from components.store import StoreError
    from pipelines.cluster import KfpError

    try:
        return check()
    except (KfpError, StoreError) as e:
        return Row(name, FAIL, str(e), fix)
    except Exception as e:  # an API client raises many types; a row says which, never a traceback
        return Row(name, FAIL, f"cannot reach {what}: {_reason(e)}", fix)


def size(n: float) -> str:
    return (
        f"{n / 2**30:.0f} GiB" if n >= 10 * 2**30 else f"{n / 2**30:.1f} GiB" if n >= 2**30 else f"{n / 2**20:.0f} MiB"
    )


# -- 1. kfp backend -----------------------------------------------------------------------------------


def check_kfp(t: Target, apis: Apis) -> Row:
    """The backend's version (its healthz; else the ml-pipeline Deployment's image tag) against
    the oldest backend the compiled IR runs on (pipelines/kfp_features.py)."""
    from pipelines import kfp_features
    from pipelines.cluster import _call, client, compile_pipeline

    name, host = "kfp backend", t.cfg.kfp.host or os.environ.get("KF_PIPELINES_ENDPOINT")
    kfp_client = client(t.cfg)
    with tempfile.TemporaryDirectory() as tmp:
        spec, platform = kfp_features.read_ir(compile_pipeline(t.cfg, Path(tmp) / "pretrain.yaml"))
    version = _call(lambda: kfp_features.backend_version(kfp_client), t.cfg)
    floor, why = kfp_features.required_backend(spec, platform)
    needs = f"the pipeline needs >= {kfp_features.show(floor)} ({why[0].name if why else 'KFP v2'})"
    seen = f"{version} at {host}"
    if kfp_features.parse_version(version) is None and (deployed := _deployed_kfp(apis)):
        version, seen = deployed[1], f"{host} reports no version; its ml-pipeline Deployment runs {deployed[0]}"
    try:
        warning = kfp_features.check_backend(version, spec, platform, host)
    except kfp_features.BackendTooOld as e:
        found = str(e).removesuffix(": upgrade the backend (deploy/README.md)")
        return Row(name, FAIL, found, f"upgrade Kubeflow Pipelines to >= {kfp_features.show(floor)} (deploy/README.md)")
    if warning:
        return Row(name, WARN, warning, "read the backend's version off `kubectl get deploy -n kubeflow ml-pipeline`")
    return Row(name, OK, f"{seen}; {needs}")


def _deployed_kfp(apis: Apis) -> tuple[str, str] | None:
    """(image, tag) of KFP's API server Deployment, or None when it cannot be read."""
    try:
        _, _, apps = apis()
        deployment = apps.read_namespaced_deployment("ml-pipeline", KFP_SYSTEM_NAMESPACE, _request_timeout=TIMEOUT_S)
        image = deployment.spec.template.spec.containers[0].image
    except Exception:  # no rights, no such Deployment: the healthz's warning stands
        return None
    return image, image_tag(image) or "latest"


# -- 2. pod security ----------------------------------------------------------------------------------


def check_pod_security(t: Target, apis: Apis) -> Row:
    """The namespace's enforced Pod Security level (no label: privileged) against the rendered
    replica pods: it must admit every one."""
    from kubernetes.client.exceptions import ApiException

    from pipelines.pod_security import ENFORCE_LABEL, LEVELS, needed, violations

    name, ns = "pod security", t.namespace
    core, _, _ = apis()
    try:
        labels = core.read_namespace(ns, _request_timeout=TIMEOUT_S).metadata.labels or {}
    except ApiException as e:
        if e.status != 404:
            raise
        return Row(
            name, FAIL, f"namespace {ns} does not exist", f"kubectl create namespace {ns}, or set cluster.namespace"
        )
    pods = t.pods()
    need = max((needed(pod) for pod in pods.values()), key=LEVELS.index)
    label = f"kubectl label namespace {ns} {ENFORCE_LABEL}={need} --overwrite"
    enforced = labels.get(ENFORCE_LABEL, "privileged")
    if enforced not in LEVELS:
        return Row(name, FAIL, f"namespace {ns} has {ENFORCE_LABEL}={enforced}, no Pod Security level", label)
    shown = f"namespace {ns} enforces {enforced}" + ("" if ENFORCE_LABEL in labels else " (no enforce label)")
    refused: dict[str, list[str]] = {}  # what the level forbids -> the stages whose replicas do it
    for stage, pod in pods.items():
        if v := violations(pod, enforced):
            refused.setdefault(", ".join(v), []).append(stage)
    if refused:
        why = "; ".join(f"{' and '.join(stages)}: {v}" for v, stages in refused.items())
        return Row(
            name,
            FAIL,
            f"{shown}; the replica pods need {need} ({why}): Volcano could create none",
            f"{label} (or drop the hostPath volumes, cluster.capabilities beyond baseline, cluster.host_network)",
        )
    return Row(name, OK, f"{shown}; the replica pods need {need}")


# -- 3. volcano ---------------------------------------------------------------------------------------

VOLCANO_INSTALL = (
    "helm install volcano volcano-sh/volcano --version 1.15.1 -n volcano-system --create-namespace (it creates "
    "the `default` queue; deploy/README.md step 0, docs/cluster.md)"
)


def check_volcano(t: Target, apis: Apis) -> Row:
    """The queue the jobs name (cluster.queue) exists and is Open."""
    from kubernetes.client.exceptions import ApiException

    name, queue = "volcano", t.jobs["train"]["spec"].get("queue") or t.typed.cluster.queue
    _, custom, _ = apis()
    try:
        found = custom.get_cluster_custom_object(
            "scheduling.volcano.sh", "v1beta1", "queues", queue, _request_timeout=TIMEOUT_S
        )
    except ApiException as e:
        if e.status != 404:
            raise
        return Row(
            name,
            FAIL,
            f"no Volcano queue {queue} (or no Volcano: queues.scheduling.volcano.sh not served)",
            f"{VOLCANO_INSTALL}, or set cluster.queue to a queue of `kubectl get queues`",
        )
    state = (found.get("status") or {}).get("state") or "without a state"
    if state != "Open":
        return Row(
            name, FAIL, f"Volcano queue {queue} is {state}: it admits no job", f"vcctl queue operate -n {queue} -a open"
        )
    return Row(name, OK, f"Volcano queue {queue} is Open")


# -- 4. gpu nodes -------------------------------------------------------------------------------------

KNOBS = {
    "cpu": "cluster.cpu",
    "memory": "cluster.mem_mb",
    "ephemeral-storage": "cluster.ephemeral_storage_gb",
    GPU: "cluster.gpu",
}


def replica_requests(pod: dict) -> dict[str, Decimal]:
    """What one replica pod asks the scheduler for: its containers' requests (a resource only
    limited is requested at its limit, as the API server defaults it)."""
    from kubernetes.utils.quantity import parse_quantity

    total: dict[str, Decimal] = {}
    for c in pod["spec"]["containers"]:
        resources = c.get("resources") or {}
        for resource, value in {**(resources.get("limits") or {}), **(resources.get("requests") or {})}.items():
            total[resource] = total.get(resource, Decimal(0)) + parse_quantity(value)
    return total


def show_quantity(resource: str, value: Decimal, places: int = 0) -> str:
    if resource in ("memory", "ephemeral-storage") or resource.startswith("hugepages-"):
        return f"{value / 2**30:.{places}f}Gi"
    return f"{value:.{places}f}" if value != value.to_integral_value() or places else str(int(value))


def _shown_pair(resource: str, have: Decimal, need: Decimal) -> str:
    """`512Gi < 745Gi`, with as many places as it takes for the two to read apart."""
    places = next((p for p in range(4) if show_quantity(resource, have, p) != show_quantity(resource, need, p)), 3)
    return f"{show_quantity(resource, have, places)} < {show_quantity(resource, need, places)}"


def _tolerated(taint, tolerations: list[dict]) -> bool:
    for tol in tolerations:
        key_ok = (
            tol.get("key") in (None, "", taint.key) if tol.get("operator") == "Exists" else tol.get("key") == taint.key
        )
        value_ok = tol.get("operator") == "Exists" or tol.get("value", "") == (taint.value or "")
        if key_ok and value_ok and tol.get("effect") in (None, "", taint.effect):
            return True
    return False


def node_misfits(node, need: dict[str, Decimal], pod: dict) -> tuple[list[str], int]:
    """Why one replica cannot land on the node (empty when it can), and how many replicas its
    allocatable holds."""
    from kubernetes.utils.quantity import parse_quantity

    spec = pod["spec"]
    labels = node.metadata.labels or {}
    allocatable = {k: parse_quantity(v) for k, v in ((node.status and node.status.allocatable) or {}).items()}
    why = ["cordoned"] if node.spec and node.spec.unschedulable else []
    for key, value in (spec.get("nodeSelector") or {}).items():
        if labels.get(key) != value:
            why.append(f"{key}={labels[key]}, not {value}" if key in labels else f"no label {key}={value}")
    for taint in (node.spec and node.spec.taints) or []:
        if taint.effect in ("NoSchedule", "NoExecute") and not _tolerated(taint, spec.get("tolerations") or []):
            why.append(f"taint {taint.key}{'=' + taint.value if taint.value else ''}:{taint.effect}")
    room = []
    for resource, amount in need.items():
        have = allocatable.get(resource, Decimal(0))
        if have < amount:
            why.append(f"{resource} {_shown_pair(resource, have, amount)}")
        elif amount > 0:
            room.append(int(have // amount))
    return why, 0 if why else min(room, default=1)


def check_nodes(t: Target, apis: Apis) -> Row:
    """Nodes whose allocatable covers one train replica's requests, on its node selector and
    past its tolerations: room for cluster.nodes replicas."""
    core, _, _ = apis()
    pod = t.pods()["train"]
    need, wanted = replica_requests(pod), t.typed.cluster.nodes
    nodes = core.list_node(_request_timeout=TIMEOUT_S).items
    kind = "GPU nodes" if need.get(GPU) else "nodes"
    if need.get(GPU):
        nodes = [n for n in nodes if n.status and n.status.allocatable and GPU in n.status.allocatable]
    judged = sorted(((n.metadata.name, *node_misfits(n, need, pod)) for n in nodes), key=lambda j: j[0])
    room = sum(r for _, _, r in judged)
    fitting = sum(1 for _, why, _ in judged if not why)
    shown = ", ".join(f"{r} {show_quantity(r, v)}" for r, v in need.items())
    found = f"{fitting} of {len(judged)} {kind} fit a replica ({shown}); room for {room} of {wanted} replicas"
    misfits = [f"{node}: {', '.join(why)}" for node, why, _ in judged if why]
    if misfits:
        found += ": " + "; ".join(misfits[:4]) + (f"; and {len(misfits) - 4} more" if len(misfits) > 4 else "")
    if room >= wanted:
        return Row("gpu nodes", OK, found)
    short = sorted({KNOBS.get(w.split()[0], "cluster.extra_resources") for _, why, _ in judged for w in why
                    if w.split()[0] in need})  # fmt: skip
    fix = f"nodes with that much allocatable (kubectl describe node), fewer cluster.nodes, or lower {', '.join(short)}"
    if not judged:
        fix = f"no node offers {GPU}: install the GPU operator (deploy/README.md step 0)"
    elif not short:
        fix = (
            "label or untaint the nodes (kubectl label / taint node), or set cluster.node_selector, fewer cluster.nodes"
        )
    return Row("gpu nodes", FAIL, found, fix)


HCAS_ANNOTATION = "liftoff.dev/hcas"  # a node's HCA names, comma-separated, where the API shows none


def node_hcas(nodes: list, gpus: int) -> tuple[list[str], str]:
    """(the HCA names NCCL would see on a GPU node, where they come from): a node's
    `liftoff.dev/hcas` annotation, else ConnectX's naming with one HCA per GPU (mlx5_0 ...), as on
    the DGX/HGX H100 and H200 nodes the presets plan (the device plugin advertises counts, not names)."""
    for n in nodes:
        listed = ((n.metadata.annotations or {}).get(HCAS_ANNOTATION) or "").strip()
        if listed:
            return [h.strip() for h in listed.split(",") if h.strip()], f"{n.metadata.name}'s {HCAS_ANNOTATION}"
    return [f"mlx5_{i}" for i in range(max(gpus, 1))], f"ConnectX naming, one HCA per GPU ({HCAS_ANNOTATION} overrides)"


def check_nccl(t: Target, apis: Apis) -> Row:
    """NCCL's environment (cluster.env, as every replica gets it) by NCCL's own rules
    (components/nccl.py) against the GPU nodes' RDMA devices: a pattern that selects none makes
    NCCL fall back to TCP sockets, which preflight's floors then refuse after the GPUs are held."""
    from components.nccl import ib_hcas_used, parse_ib_hca

    core, _, _ = apis()
    env, cluster = dict(t.typed.cluster.env or {}), t.typed.cluster
    nodes = [n for n in core.list_node(_request_timeout=TIMEOUT_S).items
             if n.status and n.status.allocatable and GPU in n.status.allocatable]  # fmt: skip
    advertised = sorted({r for n in nodes for r in n.status.allocatable if r.startswith("rdma/")})
    requested = sorted(r for r in cluster.extra_resources if r.startswith("rdma/"))
    fix = "NCCL_IB_HCA=mlx5 (a prefix: mlx5_0 ... mlx5_7) in cluster.env, with the RDMA resource (docs/cluster.md)"
    if str(env.get("NCCL_IB_DISABLE", "0")).lower() in ("1", "true"):
        return Row("nccl", WARN, "NCCL_IB_DISABLE is set: collectives run over TCP sockets", fix)
    hca = env.get("NCCL_IB_HCA")
    rdma = f"RDMA resources requested {requested or 'none'}, advertised {advertised or 'none'}"
    if not hca:
        if requested or advertised:
            return Row("nccl", OK, f"NCCL_IB_HCA unset: NCCL uses every HCA; {rdma}")
        return Row("nccl", WARN, f"no RDMA: {rdma}; NCCL runs over TCP sockets (preflight's floors refuse it)", fix)
    try:
        parse_ib_hca(str(hca))
    except ValueError as e:
        return Row("nccl", FAIL, str(e), fix)
    devices, source = node_hcas(nodes, cluster.gpu)
    used = ib_hcas_used(str(hca), devices)
    if not used:
        found = (f"NCCL_IB_HCA={hca} selects none of {', '.join(devices)} ({source}) by NCCL's rules (a leading "
                 "'=' means exact names): NCCL falls back to TCP sockets")  # fmt: skip
        return Row("nccl", FAIL, found, fix)
    return Row("nccl", OK, f"NCCL_IB_HCA={hca} selects {len(used)} of {len(devices)} HCAs ({source}); {rdma}")


# -- 5. and 6. the store ------------------------------------------------------------------------------

STORE_FIX = "run the doctor where the store is reachable (a port-forward: deploy/README.md step 1) with its keys"
CONDITIONAL_FIX = (
    "a store whose conditional writes work: MinIO (2024 or later), S3, or SeaweedFS >= 4.08 (before it, a "
    "versioned bucket ignores If-None-Match and refuses every If-Match: seaweedfs#8073)"
)


def check_conditional_writes(t: Target, store) -> Row:
    """The probe (components/store/probe.py) against the configured bucket: what the run lease needs."""
    from components.store.probe import probe_conditional_writes

    result = probe_conditional_writes(store().backend)
    where = store().backend.description
    if result.ok:
        return Row("store conditional writes", OK, f"{where}: {result.found}")
    return Row("store conditional writes", FAIL, f"{where}: {result.found}", CONDITIONAL_FIX)


def planned_store_bytes(typed) -> tuple[int, int, int]:
    """(parameters, bytes of one checkpoint, bytes the run keeps in the store at most): the newest
    train.checkpoint_keep checkpoints, one more in flight, and the model's export."""
    from components.preflight.plan_config import plan_for

    params = plan_for(typed)[0].params
    checkpoint = params * CHECKPOINT_BYTES_PER_PARAM
    return params, checkpoint, checkpoint * (typed.train.checkpoint_keep + 1) + params * EXPORT_BYTES_PER_PARAM


def check_capacity(t: Target, store) -> Row:
    """Free space where the store reports it (the local backend: its disk) against what the run
    keeps; S3 reports none: the row names the size to provision."""
    from components.config import StoreBackend
    from components.store.local import nearest_existing

    params, checkpoint, planned = planned_store_bytes(t.typed)
    keep = t.typed.train.checkpoint_keep
    count = f"{params / 1e9:.2f}B" if params >= 1e9 else f"{params / 1e6:.1f}M"
    need = (
        f"the run keeps up to {size(planned)}: {keep}+1 checkpoints of {size(checkpoint)} ({count} params x "
        f"{CHECKPOINT_BYTES_PER_PARAM} B: fp32 weights and AdamW's two moments; train.checkpoint_keep={keep}, one "
        "more in flight) and the exported model"
    )
    if t.typed.store.backend == StoreBackend.local:
        root = nearest_existing(Path(t.typed.store.root).expanduser().resolve())
        free = shutil.disk_usage(root).free
        if free < planned:
            return Row(
                "store capacity",
                FAIL,
                f"{size(free)} free under {root}; {need}",
                "free space there, a bigger disk for store.root, or a lower train.checkpoint_keep",
            )
        return Row("store capacity", OK, f"{size(free)} free under {root}; {need}")
    found = f"free space is not reported by the S3 API; {need}"
    if planned <= KFP_SEAWEEDFS_GIB * 2**30:
        return Row("store capacity", OK, found)
    return Row(
        "store capacity",
        WARN,
        found,
        f"give the store {size(planned)}: KFP 2.16's bundled SeaweedFS has a {KFP_SEAWEEDFS_GIB} Gi "
        "volume, too small: a bigger volume, or a MinIO of liftoff's own (deploy/README.md step 1)",
    )


# -- 7. image -----------------------------------------------------------------------------------------


def image_tag(image: str) -> str | None:
    """`registry:5000/liftoff:0123456789` -> `0123456789`; None when the image names no tag."""
    last = image.split("@", 1)[0].rsplit("/", 1)[-1]
    return last.partition(":")[2] or None


def is_commit(tag: str) -> bool:
    """A tag `make images` could have given: 7 to 40 hex digits, `-dirty` after them or not."""
    commit = tag.removesuffix("-dirty")
    return 7 <= len(commit) <= 40 and all(c in "0123456789abcdef" for c in commit)


def check_image(t: Target) -> Row:
    """cluster.image's tag against the commit `upload` names versions after: a commit tag must be HEAD's."""
    from components.store import code_version
    from pipelines.cluster import short_commit

    image, head = t.typed.cluster.image, short_commit(code_version())
    tag, fix = image_tag(image), f"make images, then cluster.image=<registry>/liftoff:{head}"
    if head.endswith("-dirty"):  # make images refuses a tree with changes: the image names a commit
        fix = "commit, then make images and cluster.image=<registry>/liftoff:<the new commit>"
    if head == "unknown":
        return Row("image", WARN, f"{image}: this checkout's commit is unknown (no git, no $LIFTOFF_CODE_VERSION)", fix)
    if tag is None or not is_commit(tag):
        return Row(
            "image",
            WARN,
            f"{image}: the tag {tag or '(none: latest)'} names no commit, so the pods' code cannot be tied to this "
            f"checkout ({head})",
            fix,
        )
    tag_commit, head_commit = tag.partition("-")[0], head.partition("-")[0]
    if not (head_commit.startswith(tag_commit) or tag_commit.startswith(head_commit)):
        return Row(
            "image",
            FAIL,
            f"{image} is commit {tag}, this checkout is {head}: the pods would run other code than `upload` names",
            f"{fix}, or check out {tag_commit}",
        )
    if head.endswith("-dirty"):
        return Row("image", WARN, f"{image} is this checkout's commit, which has uncommitted changes", fix)
    return Row("image", OK, f"{image} is this checkout's commit ({head})")


# -- the table ----------------------------------------------------------------------------------------


def run_checks(cfg: DictConfig, kfp: bool = True) -> list[Row]:
    """Every check's row, in order; `kfp=False` leaves out the KFP backend's (submit and upload check
    it themselves, after their other refusals, so the doctor makes no call to KFP)."""
    from components.store import open_store

    t, apis = target(cfg), Apis()
    opened = []

    def store():
        if not opened:
            opened.append(open_store(t.typed.store, create=False))
        return opened[0]

    kube = "the Kubernetes API"
    checks = [
        ("kfp backend", "Kubeflow Pipelines", "set kfp.host (or $KF_PIPELINES_ENDPOINT) and its credentials "
         "(docs/cluster.md)", lambda: check_kfp(t, apis)),
        ("pod security", kube, KUBE_FIX, lambda: check_pod_security(t, apis)),
        ("volcano", kube, KUBE_FIX, lambda: check_volcano(t, apis)),
        ("gpu nodes", kube, KUBE_FIX, lambda: check_nodes(t, apis)),
        ("nccl", kube, KUBE_FIX, lambda: check_nccl(t, apis)),
        ("store conditional writes", "the store", STORE_FIX, lambda: check_conditional_writes(t, store)),
        ("store capacity", "the store", STORE_FIX, lambda: check_capacity(t, store)),
        ("image", "the code version", "", lambda: check_image(t)),
    ]  # fmt: skip
    return [_guarded(name, what, fix, check) for name, what, fix, check in checks if kfp or name != "kfp backend"]


def table(rows: list[Row]) -> str:
    """One line a row: check, status, what was found, the fix (`-` when there is nothing to do)."""
    head = ("check", "status", "found", "fix")
    cells = [head, *((r.name, r.status, r.found, r.fix or "-") for r in rows)]
    widths = [max(len(c[i]) for c in cells) for i in range(3)]
    return "\n".join(
        "  ".join([c[0].ljust(widths[0]), c[1].ljust(widths[1]), c[2].ljust(widths[2]), c[3]]).rstrip() for c in cells
    )


def failure_line(rows: list[Row]) -> str:
    """The failing rows as one line: `NAME: found; fix: FIX`, rows apart by ` | `."""
    return " | ".join(f"{r.name}: {r.found}; fix: {r.fix}" for r in rows if r.failed)


def refuse_unhealthy(cfg: DictConfig) -> None:
    """What submit and upload run first: Unhealthy, in one line, when a check (but KFP's) fails."""
    rows = run_checks(cfg, kfp=False)
    if any(r.failed for r in rows):
        raise Unhealthy(f"{failure_line(rows)} (liftoff doctor shows every check; --skip-doctor skips them)")
