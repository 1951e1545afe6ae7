"""Load on the store: concurrent writers publishing versions of one artifact and readers
resolving `latest`, against the loopback S3 server. Prints versions/s and publish latency
percentiles (a benchmark; nothing here asserts on speed)."""

from __future__ import annotations

import statistics
import threading
import time
import uuid
from pathlib import Path

import pytest

from components.config import StoreBackend, defaults
from components.store import open_store


def run_load(endpoint: str, tmp: Path, writers: int, readers: int, seconds: float) -> dict:
    bucket = f"load-{uuid.uuid4().hex[:8]}"

    def store(i: int):
        return open_store(
            defaults(
                "store",
                backend=StoreBackend.minio,
                endpoint=endpoint,
                bucket=bucket,
                secure=False,
                timeout_s=30.0,
                cache_dir=str(tmp / f"cache-{i}"),
            )
        )

    published, latencies, reads, errors = [], [], [], []
    stop = time.monotonic() + seconds
    lock = threading.Lock()

    def writer(w: int) -> None:
        s = store(w)
        n = 0
        while time.monotonic() < stop:
            src = tmp / f"src-{w}-{n}"
            src.mkdir()
            for j in range(3):
                (src / f"part-{j}.bin").write_bytes(f"{w}-{n}-{j}".encode() * 300)
            version = f"w{w}-{n}-{uuid.uuid4().hex[:6]}"
            t0 = time.perf_counter()
            try:
                s.publish("dataset", "shared", version, src)
            except Exception as e:
                with lock:
                    errors.append(f"publish {version}: {e}")
                return
            with lock:
                latencies.append(time.perf_counter() - t0)
                published.append(version)
            n += 1

    def reader(r: int) -> None:
        s = store(100 + r)
        while time.monotonic() < stop:
            try:
                m = s.resolve("dataset", "shared", "latest")
                s.fetch(m, tmp / f"read-{r}-{uuid.uuid4().hex[:6]}")  # sha256-verified, or it raises
                with lock:
                    reads.append(m.ref.version)
            except LookupError:
                time.sleep(0.05)  # nothing published yet
            except Exception as e:
                with lock:
                    errors.append(f"read: {e}")
                return

    threads = [threading.Thread(target=writer, args=(w,)) for w in range(writers)]
    threads += [threading.Thread(target=reader, args=(r,)) for r in range(readers)]
    t0 = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    elapsed = time.perf_counter() - t0
    final = {m.ref.version for m in store(999).versions("dataset", "shared")}
    lat = sorted(latencies)
    return {
        "published": published,
        "final": final,
        "reads": reads,
        "errors": errors,
        "versions_per_s": len(published) / elapsed,
        "p50_ms": 1000 * statistics.median(lat) if lat else float("nan"),
        "p99_ms": 1000 * lat[min(len(lat) - 1, int(0.99 * len(lat)))] if lat else float("nan"),
    }


@pytest.mark.parametrize(
    "writers,readers,seconds",
    [
        pytest.param(4, 4, 5.0, id="4x4-5s"),
        pytest.param(32, 32, 30.0, id="32x32-30s", marks=pytest.mark.chaos_slow),  # 35 s: make chaos
    ],
)
def test_concurrent_publishers_and_readers(s3_endpoint, s3_env, tmp_path, chaos, writers, readers, seconds):
    rec = chaos(
        f"{writers} writers + {readers} readers of one artifact for {seconds:.0f}s (loopback S3)",
        "every version has a valid manifest, every read is complete and hash-verified, none lost",
    )
    r = run_load(s3_endpoint, tmp_path, writers, readers, seconds)
    assert not r["errors"], r["errors"][:3]
    assert r["published"] and r["reads"]
    assert r["final"] == set(r["published"])  # no version lost, no partial one visible
    assert set(r["reads"]) <= set(r["published"])
    summary = (
        f"{len(r['published'])} versions ({r['versions_per_s']:.1f}/s), publish p50 {r['p50_ms']:.0f} ms, "
        f"p99 {r['p99_ms']:.0f} ms, {len(r['reads'])} verified reads"
    )
    print(f"store load {writers}x{readers}: {summary}")
    rec.happened(summary)
