"""The versioned artifact store: a local directory or MinIO, one layout and one interface.

keys.py holds the key and manifest model (errors, Ref, Manifest, sha256, code version),
local.py and s3.py the two backends (s3.py also reads s3:// sources), artifacts.py the
store itself (publish, resolve, fetch, read_range) and open_store. Import from here.
"""

from components.store.artifacts import ArtifactStore, Backend, open_store
from components.store.keys import (
    KINDS,
    MANIFEST,
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
from components.store.local import LocalBackend
from components.store.s3 import (
    Connection,
    MinioBackend,
    ObjectSource,
    SourceObject,
    object_source,
    parse_s3_url,
)

__all__ = [
    "KINDS",
    "MANIFEST",
    "ArtifactStore",
    "Backend",
    "Connection",
    "IntegrityError",
    "InvalidKey",
    "LocalBackend",
    "Manifest",
    "MinioBackend",
    "NotFound",
    "ObjectSource",
    "Ref",
    "SourceObject",
    "StoreError",
    "StoreUnreachable",
    "check_part",
    "check_range",
    "check_relpath",
    "code_version",
    "object_source",
    "open_store",
    "parse_s3_url",
    "sha256_file",
]
