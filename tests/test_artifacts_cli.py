"""`liftoff artifacts rm | pin` and a store that is not there, through the real CLI entry, on
both backends; asserted on the objects the backend holds (S3: every object version)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from components.config import StoreBackend
from components.store import Ref, apply_retention, open_store
from pipelines.cli import main
from tests.store_objects import keys_under, object_versions


def cli_args(cfg) -> list[str]:
    """The overrides that make the CLI open the store `cfg` names."""
    args = [f"store.cache_dir={cfg.cache_dir}", f"store.root={cfg.root}"]
    if cfg.backend == StoreBackend.minio:
        args += ["store.backend=minio", f"store.bucket={cfg.bucket}", f"store.timeout_s={cfg.timeout_s}"]
    return args


def put(store, tmp: Path, ref: str, parents=(), metadata=None) -> Ref:
    r = Ref.parse(ref)
    src = tmp / "src" / r.kind / r.name / r.version
    src.mkdir(parents=True)
    (src / "payload.bin").write_bytes(ref.encode() * 64)
    store.publish(r.kind, r.name, r.version, src, metadata=metadata, parents=list(parents))
    return r


@pytest.fixture
def lineage(store, store_cfg, tmp_path):
    """dataset <- checkpoint <- model <- {eval, run}; and an unrelated second checkpoint."""
    put(store, tmp_path, "dataset/kjv@h1")
    put(store, tmp_path, "checkpoint/tiny@id-step10-aaa", ["dataset/kjv@h1"])
    put(store, tmp_path, "checkpoint/tiny@id-step20-bbb", ["dataset/kjv@h1"])
    put(store, tmp_path, "model/tiny@r1", ["dataset/kjv@h1", "checkpoint/tiny@id-step10-aaa"])
    put(store, tmp_path, "eval/tiny@e1", ["model/tiny@r1"])
    put(store, tmp_path, "run/id@launch-1", ["model/tiny@r1"])
    # an overwrite: S3 keeps the first bytes as a noncurrent version, which rm removes too
    store.backend.put_bytes("checkpoint/tiny/id-step10-aaa/payload.bin", b"again")
    return store, cli_args(store_cfg)


REMOVED = ["run/id@launch-1", "eval/tiny@e1", "model/tiny@r1", "checkpoint/tiny@id-step10-aaa"]


def test_rm_refuses_a_version_some_lineage_names(lineage, capsys):
    store, args = lineage
    before = object_versions(store)
    assert main(["artifacts", "rm", "checkpoint/tiny@id-step10-aaa", *args]) == 2
    captured = capsys.readouterr()
    assert captured.err == (
        "liftoff artifacts: checkpoint/tiny@id-step10-aaa is in the lineage of 3 versions: "
        "model/tiny@r1, eval/tiny@e1, run/id@launch-1; --with-dependants removes them too\n"
    )
    assert captured.out == "" and object_versions(store) == before  # nothing touched


def test_rm_with_dependants_removes_them_all_and_says_so(lineage, capsys):
    store, args = lineage
    assert main(["artifacts", "rm", "checkpoint/tiny@id-step10-aaa", "--with-dependants", *args]) == 0
    assert capsys.readouterr().out == "".join(f"removed {r}\n" for r in REMOVED)  # dependants before parents
    for ref in REMOVED:
        assert keys_under(store, Ref.parse(ref).prefix) == []  # no object, object version or marker
    assert store.exists(Ref.parse("dataset/kjv@h1")) and store.exists(Ref.parse("checkpoint/tiny@id-step20-bbb"))
    assert sorted(str(m.ref) for m in store.ls()) == ["checkpoint/tiny@id-step20-bbb", "dataset/kjv@h1"]


def test_rm_of_a_version_nothing_names(lineage, capsys):
    store, args = lineage
    assert main(["artifacts", "rm", "run/id@launch-1", *args]) == 0
    assert capsys.readouterr().out == "removed run/id@launch-1\n"
    assert keys_under(store, "run/id/launch-1") == [] and store.exists(Ref.parse("model/tiny@r1"))


@pytest.mark.parametrize(
    ("words", "err"),
    [
        (
            ["checkpoint/tiny"],
            "usage: liftoff artifacts rm KIND/NAME@VERSION [--with-dependants] [--force]: rm needs the version "
            "itself, 'checkpoint/tiny' names none",
        ),
        (["checkpoint/tiny@latest"], "rm needs the version itself, 'checkpoint/tiny@latest' names none"),
        ([], "usage: liftoff artifacts rm KIND/NAME@VERSION [--with-dependants] [--force]"),
    ],
)
def test_rm_needs_one_exact_version(lineage, capsys, words, err):
    store, args = lineage
    before = object_versions(store)
    assert main(["artifacts", "rm", *words, *args]) == 2
    captured = capsys.readouterr().err
    assert captured.startswith("liftoff artifacts: ") and captured.endswith(f"{err}\n"), captured
    assert len(captured.splitlines()) == 1 and object_versions(store) == before


def test_rm_of_a_version_not_stored_is_one_line(lineage, capsys):
    store, args = lineage
    assert main(["artifacts", "rm", "checkpoint/tiny@nope", *args]) == 2
    assert capsys.readouterr().err == f"liftoff artifacts: no version checkpoint/tiny@nope in {store.description}\n"


def test_pin_keeps_a_checkpoint_from_retention(store, store_cfg, tmp_path, capsys):
    args = cli_args(store_cfg)
    refs = [
        put(store, tmp_path, f"checkpoint/tiny@id-step{s}-{s:03d}", metadata={"identity": "id", "step": s})
        for s in (1, 2, 3)
    ]
    assert main(["artifacts", "pin", str(refs[0]), *args]) == 0
    assert capsys.readouterr().out == f"pinned {refs[0]}\n"
    assert f"{refs[0].prefix}/manifest.pinned.json" in keys_under(store, refs[0].prefix)
    assert apply_retention(store, "tiny", "id", keep=1) == [refs[1]]
    assert store.exists(refs[0]) and keys_under(store, refs[1].prefix) == []
    assert main(["artifacts", "unpin", str(refs[0]), *args]) == 0
    assert capsys.readouterr().out == f"unpinned {refs[0]}\n"
    assert apply_retention(store, "tiny", "id", keep=1) == [refs[0]]


# -- pins: shown, and kept from rm ------------------------------------------------------------------


def test_ls_and_show_say_which_versions_are_pinned(lineage, capsys):
    store, args = lineage
    store.pin(Ref.parse("model/tiny@r1"), reason="the release candidate")
    assert main(["artifacts", "ls", *args]) == 0
    rows = {ln.split()[0]: ln for ln in capsys.readouterr().out.splitlines()}
    assert re.fullmatch(r"model/tiny@r1 +\d{4}-\d\d-\d\d \d\d:\d\d +1 file +832 B  pinned", rows["model/tiny@r1"])
    assert [ref for ref, row in rows.items() if row.endswith("  pinned")] == ["model/tiny@r1"]
    assert main(["artifacts", "show", "model/tiny@r1", *args]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert re.fullmatch(r"  pinned        since \d{4}-\d\d-\d\d \d\d:\d\d UTC: the release candidate", lines[3]), lines
    assert main(["artifacts", "show", "eval/tiny@e1", *args]) == 0
    assert capsys.readouterr().out.splitlines()[3] == "  pinned        no"


def test_rm_refuses_a_pinned_version_unless_forced(lineage, capsys):
    store, args = lineage
    store.pin(Ref.parse("run/id@launch-1"))
    before = object_versions(store)
    assert main(["artifacts", "rm", "run/id@launch-1", *args]) == 2
    captured = capsys.readouterr()
    assert captured.err == (
        "liftoff artifacts: run/id@launch-1 is pinned; nothing removed (unpin, or --force removes pinned "
        "versions too)\n"
    )
    assert captured.out == "" and object_versions(store) == before
    assert main(["artifacts", "rm", "run/id@launch-1", "--force", *args]) == 0
    assert capsys.readouterr().out == "removed run/id@launch-1\n"
    assert keys_under(store, "run/id/launch-1") == []  # the pin went with it


def test_rm_with_dependants_refuses_when_a_dependant_is_pinned_naming_it(lineage, capsys):
    store, args = lineage
    store.pin(Ref.parse("model/tiny@r1"))
    before = object_versions(store)
    assert main(["artifacts", "rm", "checkpoint/tiny@id-step10-aaa", "--with-dependants", *args]) == 2
    captured = capsys.readouterr()
    assert captured.err == (
        "liftoff artifacts: checkpoint/tiny@id-step10-aaa: its dependant model/tiny@r1 is pinned; nothing "
        "removed (unpin, or --force removes pinned versions too)\n"
    )
    assert captured.out == "" and object_versions(store) == before  # not even the unpinned dependants went
    assert main(["artifacts", "rm", "checkpoint/tiny@id-step10-aaa", "--with-dependants", "--force", *args]) == 0
    assert capsys.readouterr().out == "".join(f"removed {r}\n" for r in REMOVED)
    assert sorted(str(m.ref) for m in store.ls()) == ["checkpoint/tiny@id-step20-bbb", "dataset/kjv@h1"]


@pytest.mark.parametrize(
    ("ref", "err"),
    [
        ("run/id@launch-1", "run/id@launch-1 is not pinned"),
        ("run/id@nope", "no version run/id@nope in {store} to unpin"),
    ],
    ids=["not-pinned", "not-stored"],
)
def test_unpin_of_a_version_that_is_not_pinned_is_one_line_exit_2(lineage, capsys, ref, err):
    store, args = lineage
    before = object_versions(store)
    assert main(["artifacts", "unpin", ref, *args]) == 2
    captured = capsys.readouterr()
    assert captured.err == f"liftoff artifacts: {err.format(store=store.description)}\n" and captured.out == ""
    assert object_versions(store) == before


# -- references: a unique version prefix, latest ---------------------------------------------------------


def test_a_unique_version_prefix_names_the_version(lineage, capsys):
    store, args = lineage
    assert main(["artifacts", "show", "checkpoint/tiny@id-step2", *args]) == 0
    assert capsys.readouterr().out.splitlines()[0] == "checkpoint/tiny@id-step20-bbb"
    assert main(["artifacts", "show", "model/tiny@latest", "--json", *args]) == 0
    assert '"version": "r1"' in capsys.readouterr().out
    assert main(["artifacts", "pin", "run/id@launch", *args]) == 0
    assert capsys.readouterr().out == "pinned run/id@launch-1\n" and store.is_pinned(Ref.parse("run/id@launch-1"))
    assert main(["artifacts", "rm", "eval/tiny@e", *args]) == 0
    assert capsys.readouterr().out == "removed eval/tiny@e1\n" and not store.holds(Ref.parse("eval/tiny@e1"))


def test_an_ambiguous_version_prefix_is_one_line_naming_the_candidates(lineage, capsys):
    store, args = lineage
    before = object_versions(store)
    for verb in ("show", "rm"):
        assert main(["artifacts", verb, "checkpoint/tiny@id-step", *args]) == 2
        captured = capsys.readouterr()
        assert captured.err == (
            "liftoff artifacts: checkpoint/tiny@id-step is ambiguous: 2 versions start with 'id-step': "
            "checkpoint/tiny@id-step10-aaa, checkpoint/tiny@id-step20-bbb\n"
        )
        assert captured.out == ""
    assert object_versions(store) == before


def test_show_marks_a_quarantined_parent(lineage, capsys):
    store, args = lineage
    store.check(Ref.parse("checkpoint/tiny@id-step10-aaa"))  # its payload was overwritten: it does not verify
    assert main(["artifacts", "show", "model/tiny@r1", *args]) == 0
    out = capsys.readouterr().out
    line = next(ln for ln in out.splitlines() if "checkpoint/tiny@id-step10-aaa" in ln)
    assert line.strip().startswith("checkpoint/tiny@id-step10-aaa  (quarantined ")
    assert "UTC: does not verify: checkpoint/tiny/id-step10-aaa/payload.bin: 5 bytes, the manifest says" in line


# -- a store that is not there ----------------------------------------------------------------------


@pytest.mark.parametrize("verb", ["ls", "show model/tiny", "rm model/tiny@r1", "pin model/tiny@r1"])
def test_artifacts_on_a_root_with_no_store_is_one_line_exit_2(tmp_path, capsys, verb):
    missing = tmp_path / "nonexistent"
    assert main(["artifacts", *verb.split(), f"store.root={missing}", f"store.cache_dir={tmp_path / 'c'}"]) == 2
    captured = capsys.readouterr()
    assert captured.err == f"liftoff artifacts: store.root={missing}: no artifact store there\n"
    assert captured.out == "" and not missing.exists()


def test_artifacts_ls_store_root_nonexistent(tmp_path, capsys):
    assert not Path("/nonexistent").exists()  # the exact command needs a root that is not there
    assert main(["artifacts", "ls", "store.root=/nonexistent", f"store.cache_dir={tmp_path / 'c'}"]) == 2
    assert capsys.readouterr().err == "liftoff artifacts: store.root=/nonexistent: no artifact store there\n"


def test_artifacts_on_a_bucket_that_does_not_exist_is_one_line_exit_2(s3_env, tmp_path, capsys):
    from tests.conftest import store_config

    cfg = store_config("minio", tmp_path)
    assert main(["artifacts", "ls", *cli_args(cfg)]) == 2
    assert capsys.readouterr().err == (
        f"liftoff artifacts: store.bucket={cfg.bucket}: no artifact store there (MinIO endpoint {s3_env})\n"
    )
    assert not open_store(store_config("minio", tmp_path)).backend.client.bucket_exists(cfg.bucket)  # not made


def test_artifacts_ls_of_an_empty_store_is_empty_exit_0(store, store_cfg, capsys):
    if store_cfg.backend == StoreBackend.local:
        Path(store_cfg.root).mkdir()  # an empty directory is an empty store (the bucket: made on open)
    assert main(["artifacts", "ls", *cli_args(store_cfg)]) == 0
    assert capsys.readouterr().out == ""
