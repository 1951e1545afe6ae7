"""The local backend: the store as a directory tree, every object written to a temp file and renamed.

Every write that fails in the store (a root that cannot be created, a full disk) is a StoreError
naming `store.root`, the path it was given and the OS's reason. Conditional writes (leases) hold
an `fcntl.flock` on a lock file beside the key, so they are atomic among the processes of one
host, and of every host of a shared file system whose locks are honoured (NFSv4, Lustre).
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import hashlib
import os
import shutil
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path

from components.store.keys import MANIFEST, InvalidKey, NotFound, StoreError, check_range, check_relpath

# errors of writing a temp file that are the store's (not the source file's)
_STORE_SIDE = (errno.ENOSPC, errno.EDQUOT, errno.EROFS, errno.EIO)


def nearest_existing(path: Path) -> Path:
    while not path.exists() and path != path.parent:
        path = path.parent
    return path


class LocalBackend:
    """A directory tree; each object is written to a temp file and renamed into place.

    create=False: the root must be an existing directory (what reading commands need): else a
    StoreError `store.root=PATH: no artifact store there`."""

    settle_s = 0.0  # conditional writes are atomic here: no read-back delay needed (lease.py)

    def __init__(self, root: Path, create: bool = True):
        self.shown = str(root)  # as configured, for messages that name store.root
        self.root = Path(root).resolve()
        self.description = f"local directory {self.root}"
        if not create and not self.root.is_dir():
            why = "" if not self.root.exists() else " (not a directory)"
            raise StoreError(f"store.root={self.shown}: no artifact store there{why}")
        if self.root.exists() and not self.root.is_dir():
            raise StoreError(f"store.root={self.shown}: cannot use it as the artifact store: Not a directory")
        above = nearest_existing(self.root)
        if above != self.root and not above.is_dir():
            raise StoreError(f"store.root={self.shown}: cannot create the artifact store there: {above} is a file")

    def _path(self, key: str) -> Path:
        if "\0" in key:
            raise InvalidKey(f"key {key!r} contains a NUL byte")
        check_relpath(key)
        p = (self.root / key).resolve()
        if self.root not in p.parents:
            raise InvalidKey(f"key {key!r} escapes the store root {self.root}")
        return p

    def _cannot(self, action: str, key: str, e: OSError) -> StoreError:
        return StoreError(f"store.root={self.shown}: cannot {action} {key} there: {e.strerror or e}")

    def _dir_for(self, key: str) -> Path:
        dest = self._path(key)
        try:
            dest.parent.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise self._cannot("write", key, e) from None
        return dest

    def _temp(self, key: str, dest: Path) -> Path:
        try:
            fd, tmp = tempfile.mkstemp(dir=dest.parent, prefix=".tmp-")
        except OSError as e:
            raise self._cannot("write", key, e) from None
        os.close(fd)
        return Path(tmp)

    def _write_temp(self, key: str, dest: Path, write: Callable[[Path], None]) -> Path:
        """A complete, fsynced temp file beside dest; removed again on any failure."""
        tmp = self._temp(key, dest)
        try:
            try:
                write(tmp)
                with open(tmp, "rb+") as f:
                    os.fsync(f.fileno())
            except OSError as e:
                if e.errno in _STORE_SIDE:
                    raise self._cannot("write", key, e) from None
                raise
        except BaseException:
            tmp.unlink(missing_ok=True)
            raise
        return tmp

    def _atomic_write(self, key: str, write: Callable[[Path], None]) -> None:
        dest = self._dir_for(key)
        tmp = self._write_temp(key, dest, write)
        try:
            os.replace(tmp, dest)
        except OSError as e:
            tmp.unlink(missing_ok=True)
            raise self._cannot("write", key, e) from None

    def put_file(self, key: str, path: Path) -> None:
        self._atomic_write(key, lambda tmp: shutil.copyfile(path, tmp))

    def put_bytes(self, key: str, data: bytes) -> None:
        self._atomic_write(key, lambda tmp: tmp.write_bytes(data))

    @contextlib.contextmanager
    def _locked(self, key: str, dest: Path) -> Iterator[None]:
        """An exclusive flock on `.<name>.lock` beside the key: conditional writes, one at a time."""
        try:
            fd = os.open(dest.parent / f".{dest.name}.lock", os.O_RDWR | os.O_CREAT, 0o644)
        except OSError as e:
            raise self._cannot("lock", key, e) from None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            yield
        finally:
            os.close(fd)  # closing the descriptor drops the lock

    def put_bytes_if_absent(self, key: str, data: bytes) -> bool:
        """Write key only when no object is there; False (nothing written) when one is. The
        complete temp file is hard-linked into place: link(2) fails when the name exists."""
        dest = self._dir_for(key)
        with self._locked(key, dest):
            tmp = self._write_temp(key, dest, lambda t: t.write_bytes(data))
            try:
                os.link(tmp, dest)
                return True
            except FileExistsError:
                return False
            except OSError as e:
                raise self._cannot("write", key, e) from None
            finally:
                tmp.unlink(missing_ok=True)

    def replace_bytes_if(self, key: str, expected: bytes, data: bytes) -> bool:
        """Write key only when it holds exactly `expected` now; False (nothing written) otherwise."""
        dest = self._dir_for(key)
        with self._locked(key, dest):
            try:
                if dest.read_bytes() != expected:
                    return False
            except FileNotFoundError:
                return False
            tmp = self._write_temp(key, dest, lambda t: t.write_bytes(data))
            try:
                os.replace(tmp, dest)
            except OSError as e:
                tmp.unlink(missing_ok=True)
                raise self._cannot("write", key, e) from None
            return True

    def get_bytes(self, key: str) -> bytes:
        try:
            return self._path(key).read_bytes()
        except (FileNotFoundError, NotADirectoryError):
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

    def digest(self, key: str, chunk: int = 1 << 20) -> tuple[str, int]:
        """(sha256 hex, size) of an object, read in chunks: nothing is copied or kept."""
        h, size = hashlib.sha256(), 0
        try:
            with open(self._path(key), "rb") as f:
                while block := f.read(chunk):
                    h.update(block)
                    size += len(block)
        except (FileNotFoundError, IsADirectoryError, NotADirectoryError):
            raise NotFound(f"{key} not found in {self.description}") from None
        return h.hexdigest(), size

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
        try:
            self._path(key).unlink(missing_ok=True)
        except OSError as e:
            raise self._cannot("delete", key, e) from None

    def purge(self, prefix: str) -> int:
        """Remove the object `prefix` or everything under `prefix/`; how many files went."""
        p = self._path(prefix)
        try:
            if p.is_dir():
                count = sum(1 for q in p.rglob("*") if not q.is_dir())
                shutil.rmtree(p)
                return count
            if p.exists() or p.is_symlink():
                p.unlink()
                return 1
        except OSError as e:
            raise self._cannot("delete", prefix, e) from None
        return 0

    def drop_history(self, key: str) -> int:
        """The local store keeps no earlier versions of an object: nothing to drop."""
        return 0
