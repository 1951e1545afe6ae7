"""The Pod Security Standards checker the tests hold rendered pods to: pipelines/pod_security.py,
where `liftoff doctor` uses it against the namespace's enforced level."""

from pipelines.pod_security import BASELINE_CAPABILITIES, ENFORCE_LABEL, LEVELS, needed, violations

__all__ = ["BASELINE_CAPABILITIES", "ENFORCE_LABEL", "LEVELS", "needed", "violations"]
