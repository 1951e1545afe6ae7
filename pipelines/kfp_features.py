"""Which Kubeflow Pipelines backend can run the pipeline `compile` emits.

The KFP SDK writes IR features that older backends ignore or reject at run time (not at
upload): a 2.5.0 driver fails the tokenize merge's `dsl.Collected` with "subTaskName ... not in
tasks" after the shards have run. `FEATURES` lists each IR feature liftoff's pipeline may
emit with the first backend release that honours it, and where that fact comes from
(repository kubeflow/pipelines, path at the tag); `required_backend` reads a compiled IR for
the ones it uses; `submit` and `upload` compare it with the backend's own version (its
healthz) and refuse an older one in one line. A test holds the table to what `compile`
emits (no IR key goes unjudged) and to the version deploy/README.md pins.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

Version = tuple[int, int, int]


def parse_version(text: str) -> Version | None:
    """`2.14.0`, `v2.14.0`, `2.14.0-rc.1` -> (2, 14, 0); None for `unknown` or anything else."""
    m = re.match(r"v?(\d+)\.(\d+)(?:\.(\d+))?", (text or "").strip())
    return (int(m[1]), int(m[2]), int(m[3] or 0)) if m else None


def show(v: Version) -> str:
    return ".".join(map(str, v))


@dataclass(frozen=True)
class Feature:
    name: str
    since: Version  # the first backend release that runs it
    source: str  # where that comes from: PR, path@tag in kubeflow/pipelines
    used: Callable[[dict, dict], bool]  # (pipeline spec, platform spec) -> whether the IR uses it


def _components(spec: dict) -> dict[str, dict]:
    return {"root": spec.get("root", {}), **spec.get("components", {})}


def _tasks(spec: dict) -> Iterator[tuple[str, str, dict]]:
    """(component holding the task, task name, task) for every DAG task in the IR."""
    for holder, comp in _components(spec).items():
        for name, task in (comp.get("dag") or {}).get("tasks", {}).items():
            yield holder, name, task


def _executors(platform: dict) -> list[dict]:
    return list(
        platform.get("platforms", {}).get("kubernetes", {}).get("deploymentSpec", {}).get("executors", {}).values()
    )


def _containers(spec: dict) -> list[dict]:
    return [e.get("container", {}) for e in spec.get("deploymentSpec", {}).get("executors", {}).values()]


def _collected(spec: dict, _platform: dict) -> bool:
    """A ParallelFor whose loop component hands outputs back out of the loop (`dsl.Collected`)."""
    comps = _components(spec)
    for _, _, task in _tasks(spec):
        if "parameterIterator" in task or "artifactIterator" in task:
            loop = comps.get(task.get("componentRef", {}).get("name", ""), {})
            if (loop.get("dag") or {}).get("outputs"):
                return True
    return False


def _retry_in_nested_dag(spec: dict, _platform: dict) -> bool:
    return any("retryPolicy" in task for holder, _, task in _tasks(spec) if holder != "root")


def _parameterised(entries: list[dict], key: str) -> bool:
    """A secret name given by a pipeline parameter rather than a constant."""
    return any("runtimeValue" not in (e.get(key) or {"runtimeValue": None}) for e in entries)


def _uses(key: str) -> Callable[[dict, dict], bool]:
    return lambda _spec, platform: any(key in e for e in _executors(platform))


FEATURES: tuple[Feature, ...] = (
    Feature(
        "dsl.Collected (fan-in of ParallelFor outputs: the tokenize merge)",
        (2, 14, 0),
        "PR #11725 (commit ed828b5); backend/src/v2/driver/resolve.go@2.14.0 CollectInputs; "
        "2.5.0's driver.go resolveUpstreamParameters fails 'subTaskName, ..., not in tasks'",
        _collected,
    ),
    Feature(
        "retryPolicy on a task inside a nested DAG (the tokenize shards' loop)",
        (2, 14, 0),
        "PRs #11908 and #11861 (2.14.0); root-DAG tasks only from 2.5.0",
        _retry_in_nested_dag,
    ),
    Feature(
        "retryPolicy on a root-DAG task",
        (2, 5, 0),
        "PR #11673; backend/src/v2/compiler/argocompiler/container.go@2.5.0",
        lambda spec, _p: any("retryPolicy" in t for holder, _, t in _tasks(spec) if holder == "root"),
    ),
    Feature(
        "a Secret name given by a pipeline parameter (secretNameParameter)",
        (2, 5, 0),
        "PR #11770; backend/src/v2/driver/driver.go@2.5.0 (a constant name also sets the old secretName)",
        lambda _s, platform: any(
            _parameterised(e.get("secretAsEnv", []) + e.get("imagePullSecret", []), "secretNameParameter")
            for e in _executors(platform)
        ),
    ),
    Feature(
        "ParallelFor parallelism (iteratorPolicy.parallelismLimit) on Argo",
        (2, 4, 0),
        "PR #10798; backend/src/v2/compiler/argocompiler/dag.go@2.4.0 (before: Tekton only)",
        lambda spec, _p: any("parallelismLimit" in t.get("iteratorPolicy", {}) for _, _, t in _tasks(spec)),
    ),
    Feature(
        "a resource request given by a pipeline parameter (resourceCpuRequest without cpuRequest)",
        (2, 4, 0),
        "PR #11501; backend/src/v2/driver/driver.go@2.4.0 "
        "(a literal request also sets the old float fields, read since 2.0.0)",
        lambda spec, _p: any(
            ("resourceCpuRequest" in r and "cpuRequest" not in r)
            or ("resourceMemoryRequest" in r and "memoryRequest" not in r)
            for r in (c.get("resources", {}) for c in _containers(spec))
        ),
    ),
    Feature(
        "emptyDir volumes (the /dev/shm mount)",
        (2, 3, 0),
        "PR #10913; backend/src/v2/driver/driver.go@2.3.0",
        _uses("emptyDirMounts"),
    ),
    Feature(
        "image pull secrets", (2, 1, 0), "PR #10427; backend/src/v2/driver/driver.go@2.1.0", _uses("imagePullSecret")
    ),
    Feature(
        "image pull policy", (2, 1, 0), "PR #10417; backend/src/v2/driver/driver.go@2.1.0", _uses("imagePullPolicy")
    ),
)

# IR keys every KFP v2 backend reads (2.0.0's driver and Argo compiler): a key `compile` emits
# that is in neither this list nor judged by a feature above fails the table's test, so a new
# SDK feature cannot reach a cluster unjudged.
BASELINE_KEYS = {
    "task": {"cachingOptions", "componentRef", "dependentTasks", "inputs", "taskInfo", "triggerPolicy"},
    "loop": {"parameterIterator", "iteratorPolicy", "retryPolicy"},
    "executor": {"secretAsEnv", "emptyDirMounts", "imagePullSecret", "imagePullPolicy"},
    "resources": {"cpuRequest", "memoryRequest", "resourceCpuRequest", "resourceMemoryRequest"},
}


def emitted(spec: dict, platform: dict) -> list[Feature]:
    return [f for f in FEATURES if f.used(spec, platform)]


def required_backend(spec: dict, platform: dict) -> tuple[Version, list[Feature]]:
    """The oldest backend that runs this IR, and the features that set that floor."""
    used = emitted(spec, platform)
    floor = max((f.since for f in used), default=(2, 0, 0))
    return floor, [f for f in used if f.since == floor]


def read_ir(path) -> tuple[dict, dict]:
    import yaml

    docs = list(yaml.safe_load_all(Path(path).read_text()))
    return docs[0], (docs[1] if len(docs) > 1 else {})


def backend_version(kfp_client: Any) -> str:
    """The backend's release, from its healthz. The SDK's model drops the field, so the raw body
    is read: the API server's own (`tag_name`, backend/src/apiserver/main.go) or, through the UI
    (ml-pipeline-ui answers /apis/v2beta1/healthz itself: frontend/server/handlers/healthz.ts),
    `apiServerTagName`. `unknown` when neither says: the server's TAG_NAME is set by the
    release build only from 2.16.0."""
    raw = kfp_client._healthz_api.healthz_service_get_healthz(_preload_content=False)
    try:
        body = json.loads(raw.data or b"{}")
    except ValueError:  # an auth proxy's page, not the healthz: cannot tell
        return "unknown"
    if not isinstance(body, dict):
        return "unknown"
    return str(body.get("tag_name") or body.get("apiServerTagName") or "unknown")


class BackendTooOld(RuntimeError):
    pass


def check_backend(version_text: str, spec: dict, platform: dict, host: str) -> str | None:
    """Raise BackendTooOld naming the feature when the backend is older than the IR needs;
    a warning (returned) when the backend does not report its version."""
    floor, why = required_backend(spec, platform)
    have = parse_version(version_text)
    if have is None:
        return (
            f"Kubeflow Pipelines at {host} does not report its version ({version_text!r}); this pipeline "
            f"needs >= {show(floor)} ({why[0].name if why else 'KFP v2'})"
        )
    if have < floor:
        raise BackendTooOld(
            f"Kubeflow Pipelines at {host} is {show(have)}; this pipeline needs >= {show(floor)} "
            f"for {why[0].name} ({why[0].source}): upgrade the backend (deploy/README.md)"
        )
    return None
