"""The fanned-out tokenization: shards, their merge, s3:// sources, and what fails how."""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

import numpy as np
import pytest
from omegaconf import OmegaConf

from components.blocks import SPLITS, ShardFile, load_tokenizer
from components.config import ConfigError, compose, defaults
from components.store import Ref, open_store
from components.tokenize.shard import ShardError
from components.tokenize.sources import DataError
from components.tokenize.stage import run_tokenize
from tests.conftest import split_corpus, store_config, upload_corpus


def configured(corpus, store_cfg, *overrides: str):
    cfg = OmegaConf.to_object(compose([f"data.paths=[{corpus}]", "data.val_fraction=0.2", *overrides]))
    cfg.store = store_cfg
    return cfg


def tokenize(cfg):
    return run_tokenize(cfg.data, cfg.tokenizer, cfg.model, open_store(cfg.store))


def documents(cfg, result) -> dict[str, Counter]:
    """Per split, the multiset of document texts the stored shards hold, decoded from their
    bytes: each shard's blocks and its tail (fewer tokens than a block), split at EOS."""
    store = open_store(cfg.store)
    tok = load_tokenizer(store.fetch(result.manifest))
    out = {s: Counter() for s in SPLITS}
    block_len = result.stats["block_len"]
    for entry in result.manifest.metadata["shards"]:
        shard = store.fetch(Ref.parse(entry["ref"]))
        for split in SPLITS:
            blocks = ShardFile(shard / f"{split}.arrow", block_len)
            ids = np.concatenate([*(blocks[j] for j in range(len(blocks))), np.load(shard / f"{split}-tail.npy")])
            ends = np.flatnonzero(ids == tok.eos_token_id)
            assert ends.size and ends[-1] == ids.size - 1  # a shard ends where its last document does
            out[split].update(tok.decode(d[:-1]) for d in np.split(ids, ends + 1)[:-1])  # each without its EOS
            blocks.close()
    return out


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> Path:
    return split_corpus(tmp_path_factory.mktemp("corpus") / "kjv-parts", parts=8)


def test_four_shards_hold_the_same_documents_as_one(corpus, tmp_path):
    one = configured(corpus, defaults("store", root=str(tmp_path / "s1"), cache_dir=str(tmp_path / "c1")))
    four = configured(
        corpus, defaults("store", root=str(tmp_path / "s4"), cache_dir=str(tmp_path / "c4")), "data.shards=4"
    )
    r1, r4 = tokenize(one), tokenize(four)
    listed = r4.manifest.metadata["shards"]
    assert len(listed) == 4 and len({s["ref"] for s in listed}) == 4
    assert r4.manifest.parents[1:] == [s["ref"] for s in listed]  # the shards are the version's lineage
    assert not any(f.endswith(".arrow") for f in r4.manifest.files)  # the merge copied no block
    for split in SPLITS:
        assert sum(s["splits"][split]["blocks"] for s in listed) == r4.stats["splits"][split]["blocks"]
    d1, d4 = documents(one, r1), documents(four, r4)
    source = Counter(json.loads(line)["text"] for p in sorted(corpus.iterdir()) for line in p.read_text().splitlines())
    assert d1 == d4  # the same train and val documents, as multisets
    assert d4["train"] + d4["val"] == source and not set(d4["train"]) & set(d4["val"])
    s1, s4 = open_store(one.store), open_store(four.store)
    assert (s1.fetch(r1.manifest) / "tokenizer" / "tokenizer.json").read_bytes() == (
        s4.fetch(r4.manifest) / "tokenizer" / "tokenizer.json"
    ).read_bytes()  # one tokenizer, trained on the same sample whatever the shard count
    assert r1.manifest.ref.version != r4.manifest.ref.version  # the blocks differ: so does the version


def test_an_s3_prefix_with_the_same_bytes_is_the_same_dataset_version(corpus, tmp_path, s3_env):
    first = store_config("minio", tmp_path / "a")
    upload_corpus(first, "sources", corpus, "corpora/kjv")
    local = tokenize(configured(corpus, first, "data.shards=2"))
    remote = configured("s3://sources/corpora/kjv", first, "data.shards=2")
    again = tokenize(remote)
    assert again.reused and again.manifest.ref == local.manifest.ref  # content, not location, decides
    fresh = store_config("minio", tmp_path / "b")  # another store: built from the objects themselves
    remote.store = fresh
    built = tokenize(remote)
    assert not built.reused and built.manifest.ref == local.manifest.ref
    a, b = open_store(first), open_store(fresh)
    for x, y in zip(local.manifest.metadata["shards"], built.manifest.metadata["shards"], strict=True):
        assert a.manifest(Ref.parse(x["ref"])).files == b.manifest(Ref.parse(y["ref"])).files  # same bytes
    sources = b.manifest(Ref.parse(built.manifest.metadata["shards"][0]["ref"])).metadata["sources"]
    assert sources[0]["uri"].startswith("s3://sources/corpora/kjv/part-")


def test_an_s3_prefix_with_no_objects_is_refused_naming_it(corpus, tmp_path, s3_env):
    cfg = store_config("minio", tmp_path)
    upload_corpus(cfg, "sources", corpus, "corpora/kjv")
    with pytest.raises(DataError, match="s3://sources/corpora/none has no objects"):
        tokenize(configured("s3://sources/corpora/none", cfg))
    assert list(open_store(cfg).ls()) == []


def test_s3_sources_need_the_store_endpoint(corpus, tmp_path):
    cfg = configured("s3://sources/corpora/kjv", defaults("store", root=str(tmp_path / "s"), cache_dir=str(tmp_path)))
    with pytest.raises(DataError, match="s3:// sources need store.backend=minio"):
        tokenize(cfg)


def test_a_failing_shard_names_itself_and_its_files_and_no_dataset_is_published(corpus, tmp_path):
    bad = tmp_path / "corpus"
    bad.mkdir()
    for p in sorted(corpus.iterdir()):
        (bad / p.name).write_bytes(p.read_bytes())
    good = (bad / "part-07.jsonl").read_text()
    (bad / "part-07.jsonl").write_text(good + "{not json\n")
    made = configured(corpus, defaults("store", root=str(tmp_path / "t"), cache_dir=str(tmp_path / "tc")))
    tokenizer = open_store(made.store).fetch(tokenize(made).manifest) / "tokenizer"
    store_cfg = defaults("store", root=str(tmp_path / "s"), cache_dir=str(tmp_path / "c"))
    # a pretrained tokenizer: the plan reads no document, so the broken file is the shard's to find
    cfg = configured(bad, store_cfg, "data.shards=4", f"tokenizer.pretrained={tokenizer}")
    with pytest.raises(
        ShardError,
        match=r"shard 4/4 of dataset/kjv@\w+ \(\S+/part-03.jsonl, \S+/part-07.jsonl\): data.paths: cannot parse "
        rf"\S+/part-07.jsonl line {good.count(chr(10)) + 1}: not valid JSON \(Expecting property name enclosed in "
        r"double quotes: column 2\)$",
    ):
        tokenize(cfg)
    store = open_store(cfg.store)
    assert list(store.ls("dataset")) == []
    assert sorted(m.ref.version.split("-")[1] for m in store.ls("shard")) == ["0of4", "1of4", "2of4"]


def test_more_shards_than_files_is_refused_before_any_work(corpus, tmp_path):
    cfg = configured(corpus, defaults("store", root=str(tmp_path / "s"), cache_dir=str(tmp_path)), "data.shards=9")
    with pytest.raises(DataError, match="data.shards=9 but the source has 8 file"):
        tokenize(cfg)
    assert list(open_store(cfg.store).ls()) == []


@pytest.mark.parametrize(
    "overrides, key",
    [
        (["data=hub"], "data.hub_revision"),
        (["tokenizer=pretrained"], "tokenizer.revision"),
    ],
)
def test_a_hub_name_without_a_revision_is_refused_at_compose(overrides, key):
    with pytest.raises(ConfigError, match=rf"{key}: pin .* to a commit of the hub repo"):
        compose(overrides)
    with pytest.raises(ConfigError, match=rf"{key}: pin .* \(a branch or tag moves\), got main"):
        compose([*overrides, f"{key}=main"])
    compose([*overrides, f"{key}=0123456789abcdef0123456789abcdef01234567"])  # pinned: fine


def test_two_files_of_one_name_under_two_entries_are_refused(corpus, tmp_path):
    """Shard tasks download objects by their names under their entries: two of one name would
    overwrite each other in a shard's scratch folder."""
    other = tmp_path / "other"
    other.mkdir()
    (other / "part-00.jsonl").write_bytes((corpus / "part-01.jsonl").read_bytes())
    store_cfg = defaults("store", root=str(tmp_path / "s"), cache_dir=str(tmp_path))
    cfg = OmegaConf.to_object(compose([f"data.paths=[{corpus},{other}]"]))
    cfg.store = store_cfg
    with pytest.raises(DataError, match="have the same name 'part-00.jsonl'"):
        tokenize(cfg)


@pytest.mark.parametrize(
    "entry, error",
    [
        ({"uri": "s3://b/k.jsonl", "relpath": "../../escaped.jsonl"}, "escaped.jsonl"),
        ({"uri": "relative/x.jsonl", "relpath": "x.jsonl"}, "not an absolute path"),
        ({"uri": "/data/../etc/x.jsonl", "relpath": "x.jsonl"}, "not an absolute path"),
    ],
)
def test_a_stored_plan_naming_a_way_out_is_refused(tmp_path, entry, error):
    """The plan travels through the store to every shard task: its file entries are checked."""
    from components.store import InvalidKey
    from components.tokenize.plan import PLAN, load_plan

    store = open_store(defaults("store", root=str(tmp_path / "s"), cache_dir=str(tmp_path / "c")))
    plan = {"dataset": "dataset/d@v1", "vocab_size": 1024, "eos_token_id": 0, "dtype": "uint16"}
    plan["partitions"] = [[{**entry, "size": 1, "digest": "0" * 32}]]
    (tmp_path / "p").mkdir()
    (tmp_path / "p" / PLAN).write_text(json.dumps(plan))
    store.publish("tokenizer", "d", "v1", tmp_path / "p")
    with pytest.raises((InvalidKey, ValueError), match=error):
        load_plan(store, "tokenizer/d@v1")
