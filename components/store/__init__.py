"""The versioned artifact store: a local directory or MinIO, one layout and one interface.

keys.py holds the key and manifest model (errors, Ref, Manifest, sha256, code version),
local.py and s3.py the two backends (connection.py reaches MinIO, with bounded retries; sources.py
reads s3:// sources), artifacts.py the store itself (publish, resolve, fetch, read_range, lineage)
and open_store, with damage.py (verify, quarantine) and deletion.py (pin, dependants, delete)
mixed in, retention.py which checkpoints are kept, lease.py one holder per training identity.
Import from here.
"""

from components.store.artifacts import ArtifactStore, Backend, open_store
from components.store.connection import Connection
from components.store.deletion import HasDependants, Pinned
from components.store.keys import (
    KINDS,
    MANIFEST,
    PINNED,
    QUARANTINED,
    IntegrityError,
    InvalidKey,
    Manifest,
    NotFound,
    Ref,
    StoreError,
    StoreUnreachable,
    check_part,
    check_range,
    check_relpath,
    code_version,
    sha256_file,
)
from components.store.lease import Lease, LeaseHeld, LeaseLost, default_holder
from components.store.local import LocalBackend
from components.store.retention import apply_retention, plan_retention
from components.store.s3 import MinioBackend
from components.store.sources import ObjectSource, SourceObject, object_source, parse_s3_url

__all__ = [
    "KINDS",
    "MANIFEST",
    "PINNED",
    "QUARANTINED",
    "ArtifactStore",
    "Backend",
    "Connection",
    "HasDependants",
    "IntegrityError",
    "InvalidKey",
    "Lease",
    "LeaseHeld",
    "LeaseLost",
    "LocalBackend",
    "Manifest",
    "MinioBackend",
    "NotFound",
    "ObjectSource",
    "Pinned",
    "Ref",
    "SourceObject",
    "apply_retention",
    "StoreError",
    "StoreUnreachable",
    "check_part",
    "check_range",
    "check_relpath",
    "code_version",
    "default_holder",
    "object_source",
    "open_store",
    "parse_s3_url",
    "plan_retention",
    "sha256_file",
]
