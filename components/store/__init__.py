"""The versioned artifact store (moved into a package; the split into modules follows)."""

from components.store.artifacts import (
    KINDS,
    MANIFEST,
    ArtifactStore,
    IntegrityError,
    InvalidKey,
    Manifest,
    NotFound,
    Ref,
    StoreError,
    StoreUnreachable,
    check_part,
    check_relpath,
    code_version,
    open_store,
    sha256_file,
)

__all__ = [
    "KINDS",
    "MANIFEST",
    "ArtifactStore",
    "IntegrityError",
    "InvalidKey",
    "Manifest",
    "NotFound",
    "Ref",
    "StoreError",
    "StoreUnreachable",
    "check_part",
    "check_relpath",
    "code_version",
    "open_store",
    "sha256_file",
]
