"""The local backend: the store as a directory tree, every object written to a temp file and renamed."""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path

from components.store.keys import MANIFEST, InvalidKey, NotFound, check_range, check_relpath


class LocalBackend:
    """A directory tree; each object is written to a temp file and renamed into place."""

    def __init__(self, root: Path):
        self.root = Path(root).resolve()
        self.description = f"local directory {self.root}"

    def _path(self, key: str) -> Path:
        if "\0" in key:
            raise InvalidKey(f"key {key!r} contains a NUL byte")
        check_relpath(key)
        p = (self.root / key).resolve()
        if self.root not in p.parents:
            raise InvalidKey(f"key {key!r} escapes the store root {self.root}")
        return p

    def _atomic_write(self, key: str, write: Callable[[Path], None]) -> None:
        dest = self._path(key)
        dest.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=dest.parent, prefix=".tmp-")
        os.close(fd)
        try:
            write(Path(tmp))
            with open(tmp, "rb+") as f:
                os.fsync(f.fileno())
            os.replace(tmp, dest)
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise

    def put_file(self, key: str, path: Path) -> None:
        self._atomic_write(key, lambda tmp: shutil.copyfile(path, tmp))

    def put_bytes(self, key: str, data: bytes) -> None:
        self._atomic_write(key, lambda tmp: tmp.write_bytes(data))

    def get_bytes(self, key: str) -> bytes:
        try:
            return self._path(key).read_bytes()
        except FileNotFoundError:
            raise NotFound(f"{key} not found in {self.description}") from None

    def get_range(self, key: str, offset: int, length: int) -> bytes:
        """length bytes from offset, fewer at the end of the file (none past it)."""
        check_range(offset, length)
        try:
            with open(self._path(key), "rb") as f:
                f.seek(offset)
                return f.read(length)
        except (FileNotFoundError, IsADirectoryError, NotADirectoryError):
            raise NotFound(f"{key} not found in {self.description}") from None

    def get_file(self, key: str, dest: Path) -> None:
        src = self._path(key)
        if not src.is_file():
            raise NotFound(f"{key} not found in {self.description}")
        shutil.copyfile(src, dest)

    def list_prefixes(self, prefix: str) -> list[str]:
        d = self._path(prefix) if prefix else self.root
        if not d.is_dir():
            return []
        return sorted(p.name for p in d.iterdir() if p.is_dir() and not p.name.startswith("."))

    def list_manifests(self, prefix: str) -> dict[str, float]:
        d = self._path(prefix)
        if not d.is_dir():
            return {}
        found = {}
        for version in d.iterdir():
            try:
                found[version.name] = (version / MANIFEST).stat().st_mtime
            except (FileNotFoundError, NotADirectoryError):
                continue
        return found

    def list_sizes(self, prefix: str) -> dict[str, int]:
        d = self._path(prefix)
        if not d.is_dir():
            return {}
        return {
            p.relative_to(d).as_posix(): p.stat().st_size
            for p in d.rglob("*")
            if p.is_file() and not p.name.startswith(".tmp-")
        }

    def delete(self, key: str) -> None:
        self._path(key).unlink(missing_ok=True)
