"""The Kubernetes Pod Security Standards, checked on a pod's metadata and spec: the controls of
the `baseline` and `restricted` levels as published for policy version v1.30
(https://kubernetes.io/docs/concepts/security/pod-security-standards/; `privileged` admits
everything). Linux pods only: the Windows exemptions of `restricted` are left out. `liftoff
doctor` holds the rendered replica pods to the level their namespace enforces; the tests hold
them to the published levels (tests/pipeline/test_pod_security.py)."""

from __future__ import annotations

LEVELS = ("restricted", "baseline", "privileged")  # strictest first; each admits what the one before does
ENFORCE_LABEL = "pod-security.kubernetes.io/enforce"
# baseline, Capabilities: adding any other is forbidden
BASELINE_CAPABILITIES = frozenset(
    {
        "AUDIT_WRITE",
        "CHOWN",
        "DAC_OVERRIDE",
        "FOWNER",
        "FSETID",
        "KILL",
        "MKNOD",
        "NET_BIND_SERVICE",
        "SETFCAP",
        "SETGID",
        "SETPCAP",
        "SETUID",
        "SYS_CHROOT",
    }
)
# baseline, Sysctls: the safe set (the last four since policy v1.29)
SAFE_SYSCTLS = frozenset(
    {
        "kernel.shm_rmid_forced",
        "net.ipv4.ip_local_port_range",
        "net.ipv4.ip_unprivileged_port_start",
        "net.ipv4.tcp_syncookies",
        "net.ipv4.ping_group_range",
        "net.ipv4.ip_local_reserved_ports",
        "net.ipv4.tcp_keepalive_time",
        "net.ipv4.tcp_fin_timeout",
        "net.ipv4.tcp_keepalive_intvl",
        "net.ipv4.tcp_keepalive_probes",
    }
)
SELINUX_TYPES = frozenset({"", "container_t", "container_init_t", "container_kvm_t", "container_engine_t"})
# restricted, Volume Types: only these
RESTRICTED_VOLUMES = frozenset(
    {"configMap", "csi", "downwardAPI", "emptyDir", "ephemeral", "persistentVolumeClaim", "projected", "secret"}
)
APPARMOR_ANNOTATION = "container.apparmor.security.beta.kubernetes.io/"


def _containers(spec: dict) -> list[dict]:
    return [*spec.get("initContainers", []), *spec.get("containers", []), *spec.get("ephemeralContainers", [])]


def _sc(obj: dict) -> dict:
    return obj.get("securityContext") or {}


def _baseline(pod: dict) -> list[str]:
    meta, spec = pod.get("metadata") or {}, pod["spec"]
    psc = _sc(spec)
    out = []
    contexts = [("pod", psc)] + [(f"container {c['name']}", _sc(c)) for c in _containers(spec)]
    for where, sc in contexts:
        if (sc.get("windowsOptions") or {}).get("hostProcess"):
            out.append(f"HostProcess: {where}")
        if sc.get("privileged"):
            out.append(f"Privileged Containers: {where}")
        added = sorted(set((sc.get("capabilities") or {}).get("add") or []) - BASELINE_CAPABILITIES)
        if added:
            out.append(f"Capabilities: {where} adds {', '.join(added)}")
        if (sc.get("seccompProfile") or {}).get("type") == "Unconfined":
            out.append(f"Seccomp: {where} is Unconfined")
        if (sc.get("appArmorProfile") or {}).get("type") == "Unconfined":
            out.append(f"AppArmor: {where} is Unconfined")
        selinux = sc.get("seLinuxOptions") or {}
        if selinux.get("type", "") not in SELINUX_TYPES or selinux.get("user") or selinux.get("role"):
            out.append(f"SELinux: {where} sets {selinux}")
        if sc.get("procMount", "Default") != "Default":
            out.append(f"/proc Mount Type: {where}")
    for key in ("hostNetwork", "hostPID", "hostIPC"):
        if spec.get(key):
            out.append(f"Host Namespaces: {key}")
    for volume in spec.get("volumes", []):
        if "hostPath" in volume:
            out.append(f"HostPath Volumes: {volume['name']}")
    for c in _containers(spec):
        for port in c.get("ports", []):
            if port.get("hostPort"):
                out.append(f"Host Ports: container {c['name']} hostPort {port['hostPort']}")
    for key, value in (meta.get("annotations") or {}).items():
        if key.startswith(APPARMOR_ANNOTATION) and value != "runtime/default" and not value.startswith("localhost/"):
            out.append(f"AppArmor: {key}={value}")
    for sysctl in psc.get("sysctls", []):
        if sysctl["name"] not in SAFE_SYSCTLS:
            out.append(f"Sysctls: {sysctl['name']}")
    return out


def _restricted(pod: dict) -> list[str]:
    spec = pod["spec"]
    psc = _sc(spec)
    out = []
    for volume in spec.get("volumes", []):
        kinds = set(volume) - {"name"}
        if not kinds <= RESTRICTED_VOLUMES:
            out.append(f"Volume Types: {volume['name']} is {', '.join(sorted(kinds))}")
    pod_seccomp = (psc.get("seccompProfile") or {}).get("type")
    if psc.get("runAsUser") == 0:
        out.append("Running as Non-root user: pod runAsUser 0")
    for c in _containers(spec):
        sc, where = _sc(c), f"container {c['name']}"
        if sc.get("allowPrivilegeEscalation") is not False:
            out.append(f"Privilege Escalation: {where} does not set allowPrivilegeEscalation false")
        if sc.get("runAsNonRoot", psc.get("runAsNonRoot")) is not True:
            out.append(f"Running as Non-root: {where}")
        if sc.get("runAsUser") == 0:
            out.append(f"Running as Non-root user: {where} runAsUser 0")
        if (sc.get("seccompProfile") or {}).get("type", pod_seccomp) not in ("RuntimeDefault", "Localhost"):
            out.append(f"Seccomp: {where} sets no RuntimeDefault or Localhost profile")
        caps = sc.get("capabilities") or {}
        if "ALL" not in (caps.get("drop") or []):
            out.append(f"Capabilities: {where} does not drop ALL")
        added = sorted(set(caps.get("add") or []) - {"NET_BIND_SERVICE"})
        if added:
            out.append(f"Capabilities: {where} adds {', '.join(added)} (restricted: NET_BIND_SERVICE only)")
    return out


def violations(pod: dict, level: str) -> list[str]:
    """The controls of `level` the pod ({metadata, spec}) breaks, one line each; [] admits it."""
    if level not in LEVELS:
        raise ValueError(f"no Pod Security level {level!r}: one of {', '.join(LEVELS)}")
    if level == "privileged":
        return []
    found = _baseline(pod)
    return found + _restricted(pod) if level == "restricted" else found


def needed(pod: dict) -> str:
    """The strictest level that admits the pod."""
    return next(level for level in LEVELS if not violations(pod, level))
