"""What a store's backend really holds, listed past the store's own view: for tests that assert on
stored objects (local: the files under the root; S3: every object version and delete marker,
noncurrent ones included, from boto3's list_object_versions)."""

from __future__ import annotations

import os
from pathlib import Path

from components.store import ArtifactStore, LocalBackend
from tests.conftest import S3_ACCESS_KEY, S3_SECRET_KEY


def boto3_client(store: ArtifactStore):
    import boto3

    endpoint = store.backend.endpoint
    return boto3.client(
        "s3",
        endpoint_url=f"http://{endpoint}",
        aws_access_key_id=os.environ.get("MINIO_ACCESS_KEY", S3_ACCESS_KEY),
        aws_secret_access_key=os.environ.get("MINIO_SECRET_KEY", S3_SECRET_KEY),
        region_name="us-east-1",
    )


def object_versions(store: ArtifactStore, prefix: str = "") -> list[tuple[str, str]]:
    """(key relative to the store, what) for every stored thing under prefix: locally each file
    as (key, "file"); on S3 each object version as (key, "current" | "noncurrent") and each
    delete marker as (key, "delete-marker"). Sorted."""
    backend = store.backend
    if isinstance(backend, LocalBackend):
        base = backend.root / prefix if prefix else backend.root
        if base.is_file():
            return [(prefix, "file")]
        if not base.is_dir():
            return []
        return sorted(
            (p.relative_to(backend.root).as_posix(), "file")
            for p in Path(base).rglob("*")
            if p.is_file() and not p.name.endswith(".lock")
        )
    client = boto3_client(store)
    root = f"{backend.prefix}/" if backend.prefix else ""
    found = []
    for page in client.get_paginator("list_object_versions").paginate(Bucket=backend.bucket, Prefix=root + prefix):
        for v in page.get("Versions", []):
            found.append((v["Key"][len(root) :], "current" if v["IsLatest"] else "noncurrent"))
        for d in page.get("DeleteMarkers", []):
            found.append((d["Key"][len(root) :], "delete-marker"))
    return sorted(found)


def keys_under(store: ArtifactStore, prefix: str) -> list[str]:
    """Every key with anything stored under `prefix/` (any version, any delete marker)."""
    return sorted({k for k, _ in object_versions(store, prefix) if k == prefix or k.startswith(prefix + "/")})


def is_s3(store: ArtifactStore) -> bool:
    return not isinstance(store.backend, LocalBackend)
