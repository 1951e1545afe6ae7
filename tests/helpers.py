"""What several test modules share: override lists, helpers that run or read a run, and the
headless browser the report tests look through. Test modules import these from here, never from
one another. The imports that pull in torch are inside the functions that need them, so a test
module that only needs a list of overrides does not load torch."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
from html.parser import HTMLParser
from pathlib import Path
from typing import TYPE_CHECKING

from components.config import StoreBackend, defaults
from components.plots import read_records
from components.store import open_store
from tests.conftest import CORPUS, ROOT, Trainer

if TYPE_CHECKING:
    import torch


# --- overrides

TWO_NODES = ["cluster.nodes=2", "cluster.procs_per_node=1"]

FAST = [
    f"data.paths=[{CORPUS}]",
    "train.steps=10",
    "train.warmup_steps=2",
    "train.checkpoint_interval=5",
    "eval.val_blocks=8",
    "eval.max_new_tokens=4",
    "preflight.gemm_size=128",
    "preflight.membw_mb=8",
]

# the one-process fp32 run the layout tests (HSDP, TP, PP) hold theirs to (the `one_process`
# fixture): four blocks (two pipeline stages of two), 8 sequences a step, 10 steps
LAYOUT = ["train.precision=fp32", "train.warmup_steps=2", "train.checkpoint_interval=10", "model.num_layers=4"]
LAYOUT_BLOCKS = 4

# one process in fp32: four whole runs of the DAG at toy size
TOY = [*FAST, "cluster.nodes=1", "train.precision=fp32", "train.activation_checkpointing=off"]

CLUSTER = [
    "cluster=kubernetes",
    "store=minio",
    "cluster.nodes=2",
    "cluster.procs_per_node=8",
    "cluster.image=registry.example.com/liftoff:0123456789",
    "+cluster.node_selector={nvidia.com/gpu.product:NVIDIA-H200}",
]

# the FSDP + fp8 + activation checkpointing + compile variant (2.5 min on 2 cores, three compiles)
# is in the chaos suite: tests/chaos/test_faults.py, `make chaos`
FSDP_FP8_AC_COMPILE = [
    "train.parallelism=fsdp",
    "train.precision=fp8",
    "train.activation_checkpointing=full",
    "train.compile=true",
    "train.grad_accum_steps=2",
    "train.micro_batch_size=4",
]


# --- the command line and a run's output (tests/test_cli.py, tests/pipeline/)


def cli(*args: str, **kw) -> subprocess.CompletedProcess:
    """`python -m pipelines.cli` on this checkout, as the `liftoff` entry point runs it."""
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    return subprocess.run(
        [sys.executable, "-m", "pipelines.cli", *args], cwd=ROOT, env=env, capture_output=True, text=True, **kw
    )


def one_error_line(proc: subprocess.CompletedProcess) -> str:
    assert proc.returncode != 0
    err = proc.stderr.strip().splitlines()
    assert len(err) == 1, proc.stderr
    assert "Traceback" not in proc.stderr and "\x1b[" not in proc.stderr + proc.stdout
    assert re.search(r"full log: (\S+run\.log)\)$", err[0])
    return err[0]


# --- the store (tests/test_store.py, tests/chaos/)


def make_tree(root: Path, seed: str) -> Path:
    (root / "sub").mkdir(parents=True)
    (root / "a.txt").write_text(f"alpha {seed}")
    (root / "sub" / "b.bin").write_bytes(seed.encode() * 1000)
    return root


# --- training runs (tests/train/, tests/stages/, tests/chaos/)


def events(metrics: Path, kind: str) -> list[dict]:
    return [e for e in read_records(metrics)[1] if e["kind"] == kind]


def stored_checkpoints(trainer, run) -> dict[int, object]:
    """step -> manifest of the run's checkpoint versions in the store."""
    mine = [m for m in trainer.store.versions("checkpoint", "tiny") if m.metadata["identity"] == run.identity]
    return {m.metadata["step"]: m for m in mine}


def final_weights(run) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(str(run.export / "model.safetensors"))


def assert_trains_like(one, others, steps: int = 10, tol: float = 1e-4) -> None:
    """Each of `others` trained `one`'s losses (relative) and exported its weights within `tol`."""
    losses = [[r["loss"] for r in read_records(run.metrics)[0]] for run in (one, *others)]
    assert [len(x) for x in losses] == [steps] * len(losses)
    for other in losses[1:]:
        assert all(abs(a - b) <= tol * abs(a) for a, b in zip(losses[0], other, strict=True)), losses
    a = final_weights(one)
    for run in others:
        b = final_weights(run)
        assert a.keys() == b.keys() and max(float((a[k] - b[k]).abs().max()) for k in a) < tol


def killed_rank_resumes_to_identical_weights(dataset_store, tmp_path, setup: list[str]) -> None:
    from tests.faults import injected

    common = [*TWO_NODES, *setup, "train.steps=30", "train.checkpoint_interval=10", "cluster.max_restarts=1"]
    clean = Trainer(dataset_store, tmp_path / "clean").run(*common)
    with injected(kill_rank=1, kill_step=15):
        killed = Trainer(dataset_store, tmp_path / "killed").run(*common)
    clean_steps, _ = read_records(clean.metrics)
    assert clean.final_loss < 0.9 * clean_steps[0]["loss"]  # gradients reach the (sharded) weights
    if setup:  # the trained model: 2 blocks + the root sharded, 2 blocks checkpointed and compiled,
        # and the 14 Float8Linear weights all-gathered in fp8 (tensorwise scaling)
        wrapped = {"fsdp": 3, "activation_checkpoint": 2, "compiled": 2, "fp8_all_gather_params": 14}
        wrapped["fp8_precomputed_scales"] = 14  # precompute_float8_dynamic_scale_for_fsdp ran after the step
        assert {k: killed.result.wrapped_modules[k] for k in wrapped} == wrapped
        assert killed.result.float8_linear_count == 14
        # FSDP2's MixedPrecisionPolicy: the block computes with bf16 parameters (fp32 masters)
        assert killed.result.forward_dtypes == {"norm_weight": "torch.bfloat16"}
    else:
        assert clean.result.forward_dtypes == {"norm_weight": "torch.float32"}
    starts = events(killed.metrics, "start")
    assert len(starts) == 2 and starts[1]["step"] == 10 and "-step10-" in starts[1]["resumed_from"]
    # the relaunch replaced the run's event file: still one, steps 11-14 (trained twice) once each
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    tb = list((killed.run_dir / "nodes" / "0" / "run" / "tensorboard").glob("events.out.tfevents.*"))
    assert len(tb) == 1
    assert [e.step for e in EventAccumulator(str(tb[0])).Reload().Scalars("train/loss")] == list(range(1, 31))
    a, b = final_weights(clean), final_weights(killed)
    assert a.keys() == b.keys()
    assert max(float((a[k] - b[k]).abs().max()) for k in a) <= 1e-6


def s3_trainer(dataset_store, tmp, bucket: str) -> Trainer:
    """A Trainer whose store is a bucket on the loopback S3 server, holding the tokenized corpus."""
    trainer = Trainer(dataset_store, tmp)
    cfg = defaults(
        "store", backend=StoreBackend.minio, bucket=bucket, root="", cache_dir=str(tmp / "cache"),
        secret_name="liftoff-minio", timeout_s=10.0,
    )  # fmt: skip
    store = open_store(cfg)
    source = dataset_store / "store"
    for path in sorted(p for p in source.rglob("*") if p.is_file()):
        store.backend.put_file(path.relative_to(source).as_posix(), path)
    trainer.store_cfg, trainer.store = cfg, store
    return trainer


def allocated(path) -> int:
    """Bytes the file holds on disk: a block never written is a hole and takes none."""
    return path.stat().st_blocks * 512 if path.exists() else 0


def shared_bytes(ckpt_dir, name: str, block: int) -> int:
    """The bytes of the items in shard file `name` that every rank reads (DCP's byte items and
    whole tensors: the replicated ones saved once), rounded out to whole blocks, plus one block:
    the most a rank of the same layout may fetch of another rank's file."""
    from torch.distributed.checkpoint.metadata import BytesStorageMetadata

    from components import checkpoint_format as ckpt

    md = ckpt.read_metadata_safely(ckpt_dir / ".metadata")
    shared = 0
    for index, info in md.storage_data.items():
        stored = md.state_dict_metadata[index.fqn]
        whole = isinstance(stored, BytesStorageMetadata) or all(
            tuple(c.sizes) == tuple(stored.size) for c in stored.chunks
        )
        shared += info.length if info.relative_path == name and whole else 0
    return -(-shared // block) * block + block


# --- reports in headless Chromium (tests/stages/test_eval_report.py, tests/pipeline/test_compare.py)

WIDTH, HEIGHT = 1200, 2000

# a rendered copy reports what the browser made of each image and of the header
PROBE = """<script>
window.addEventListener('load', () => {
  const imgs = [...document.images].map(i => {
    const r = i.getBoundingClientRect();
    return {alt: i.alt, w: i.naturalWidth, h: i.naturalHeight, x: r.left, y: r.top, rw: r.width, rh: r.height};
  });
  const header = document.querySelector('#identity');
  const out = document.createElement('pre');
  out.id = 'probe';
  const headerBg = getComputedStyle(header).backgroundColor;
  out.textContent = JSON.stringify({imgs, header: header.innerText, headerBg});
  document.body.appendChild(out);
});
</script>"""


def chromium(tmp_path: Path, *args: str) -> subprocess.CompletedProcess:
    exe = shutil.which("chromium")
    assert exe, "chromium is not installed: `make test` installs Debian's package (apt-get install chromium)"
    # its own HOME, TMPDIR and profile, at a short path: chromium puts its singleton socket
    # there, and a unix socket path over 107 bytes aborts it (pytest's tmp_path can be longer)
    short = Path(tempfile.mkdtemp(prefix="chr-", dir="/tmp"))
    flags = [
        "--headless", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage", "--disable-quic",
        "--no-first-run", "--disable-background-networking", "--disable-component-update", "--disable-sync",
        "--hide-scrollbars", f"--user-data-dir={short / 'profile'}", f"--window-size={WIDTH},{HEIGHT}",
    ]  # fmt: skip
    env = {**os.environ, "HOME": str(short), "TMPDIR": str(short)}
    try:
        proc = subprocess.run([exe, *flags, *args], capture_output=True, text=True, timeout=120, env=env)
    finally:
        shutil.rmtree(short, ignore_errors=True)
    assert proc.returncode == 0, f"chromium exited {proc.returncode}: {proc.stderr[-2000:]}"
    return proc


class _Probe(HTMLParser):
    def __init__(self):
        super().__init__()
        self.inside, self.text = False, ""

    def handle_starttag(self, tag, attrs):
        self.inside = self.inside or dict(attrs).get("id") == "probe"

    def handle_data(self, data):
        if self.inside:
            self.text += data


def rendered(tmp_path: Path, report: Path) -> dict:
    probed = tmp_path / "probed.html"
    probed.write_text(report.read_text().replace("</body>", PROBE + "</body>"))
    dom = chromium(tmp_path, "--virtual-time-budget=5000", "--dump-dom", probed.as_uri()).stdout
    parser = _Probe()
    parser.feed(dom)
    assert parser.text, f"the probe script did not run; DOM starts {dom[:300]!r}"
    return json.loads(parser.text)


class LoopbackServer:
    """A test's HTTP server on 127.0.0.1 (`self.server`, served by `self.thread`), started and shut
    down by `with`: the fake KFP and Kubernetes API servers and the store proxy."""

    server: object
    thread: object

    def __enter__(self):
        self.thread.start()
        return self

    def __exit__(self, *exc):
        self.server.shutdown()
        self.server.server_close()


# `liftoff doctor`'s rows, in the order its table prints them (tests/pipeline/test_doctor.py, test_cli_errors.py)
DOCTOR_ROWS = [
    "kfp backend",
    "pod security",
    "volcano",
    "gpu nodes",
    "nccl",
    "store conditional writes",
    "store capacity",
    "image",
]
