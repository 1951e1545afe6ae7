"""Data mixtures (issue 44): sources tokenized once each, drawn by weight at train time."""

from __future__ import annotations

import hashlib
import math

import numpy as np
import pytest
from omegaconf import OmegaConf

from components.config import ConfigError, compose, defaults
from components.prelaunch import DataFitError
from components.store import Ref, open_store
from components.stream import open_split
from components.tokenize.stage import run_tokenize
from components.train.data import BlockSampler, Mixture
from tests.conftest import ROOT

MIX = [
    "experiment=tiny-mix",
    f"data.sources.kjv.paths=[{ROOT / 'corpus' / 'kjv.jsonl'}]",
    f"data.sources.pystdlib.paths=[{ROOT / 'corpus' / 'pystdlib.jsonl'}]",
]


@pytest.fixture(scope="module")
def mixed(tmp_path_factory):
    """The tiny-mix corpus tokenized once: (config, store, the corpus's manifest)."""
    root = tmp_path_factory.mktemp("mixture")
    store_over = [f"store.root={root / 'store'}", f"store.cache_dir={root / 'cache'}"]
    cfg = OmegaConf.to_object(compose([*MIX, *store_over]))
    store = open_store(cfg.store)
    return cfg, store, run_tokenize(cfg.data, cfg.tokenizer, cfg.model, store).manifest


def within_binomial(count: int, n: int, w: float) -> bool:
    """`count` of `n` draws at probability `w`, within 4 standard deviations (and one draw)."""
    return abs(count - w * n) <= 4 * math.sqrt(n * w * (1 - w)) + 1


def source_of_shard(blocks) -> list[str]:
    """Each shard's source, from the corpus's shard listing (not from the sampler)."""
    return [row["source"] for row in blocks.shards]


@pytest.mark.parametrize("weights", [{"kjv": 0.7, "pystdlib": 0.3}, {"kjv": 0.15, "pystdlib": 0.85}])
def test_the_sampler_draws_each_source_by_its_weight_at_every_prefix(mixed, weights):
    cfg, store, corpus = mixed
    blocks = open_split(store, corpus, "train")
    named = source_of_shard(blocks)
    sampler = BlockSampler(blocks, 8, 1, 2, 0, 0, Mixture.of(blocks, weights))
    pairs = sampler.locate_many(0, 6000)
    for n in (40, 600, 6000):
        counted = {s: sum(named[shard] == s for shard, _ in pairs[:n]) for s in weights}
        assert sampler.drawn(n) == counted  # the sampler's own record is what it drew
        for s, w in weights.items():
            assert within_binomial(counted[s], n, w), (n, s, counted)


def test_each_source_is_drawn_in_whole_passes_and_a_cap_stops_it(mixed):
    cfg, store, corpus = mixed
    blocks = open_split(store, corpus, "train")
    sizes = {s: corpus.metadata["stats"]["sources"][s]["train"]["blocks"] for s in ("kjv", "pystdlib")}
    sampler = BlockSampler(blocks, 8, 1, 1, 0, 0, Mixture.of(blocks, {"kjv": 0.5, "pystdlib": 0.5}))
    n = 2 * sizes["kjv"] + 50  # past the end of kjv's first pass
    per = {"kjv": [], "pystdlib": []}
    for shard, block in sampler.locate_many(0, n):
        per[blocks.shards[shard]["source"]].append((shard, block))
    first = per["kjv"][: sizes["kjv"]]
    assert len(set(first)) == sizes["kjv"]  # every kjv block once in its first pass
    assert per["kjv"][sizes["kjv"] :] != first[: len(per["kjv"]) - sizes["kjv"]]  # the next pass reshuffled
    capped = BlockSampler(blocks, 8, 1, 1, 0, 0, Mixture.of(blocks, {"kjv": 0.5, "pystdlib": 0.5}, {"kjv": 1.0}))
    capped.locate_many(0, 2 * sizes["kjv"] - 10)
    with pytest.raises(DataFitError, match=r"data.sources.kjv.max_epochs=1: the run reached draw"):
        capped.locate_many(2 * sizes["kjv"] - 10, 2 * sizes["kjv"] + 10)


def block_hashes(sampler: BlockSampler, start: int, steps: int, ranks: list[BlockSampler]) -> list[str]:
    """The sha256 of every block the ranks read, step by step, in global sample order."""
    out, sample = [], start
    for _ in range(steps):
        for r in ranks:
            out += [hashlib.sha256(row.tobytes()).hexdigest() for row in r.batch(sample, "cpu").numpy()]
        sample += sampler.micro * sampler.world
    return out


def test_a_two_rank_run_resumed_on_one_rank_draws_the_blocks_of_the_uninterrupted_run(mixed):
    """Acceptance 3, the sampler's part: the order is global, so a resume at the checkpointed
    sample on another number of ranks reads the same bytes (the workers' resume of the sample
    position on another world size is tests/train's)."""
    cfg, store, corpus = mixed
    blocks = open_split(store, corpus, "train")
    mix = Mixture.of(blocks, {"kjv": 0.6, "pystdlib": 0.4})
    two = [BlockSampler(blocks, 4, 1, 2, r, 7, mix) for r in range(2)]
    whole = block_hashes(two[0], 0, 30, two)
    fresh = [BlockSampler(blocks, 4, 1, 2, r, 7, mix) for r in range(2)]  # new processes: no cursor carried
    first = block_hashes(fresh[0], 0, 12, fresh)
    one = BlockSampler(blocks, 8, 1, 1, 0, 7, mix)  # one node takes both ranks' share of each step
    rest = block_hashes(one, 12 * 8, 18, [one])
    assert first + rest == whole
    assert len(set(whole)) > 200  # real, distinct blocks


def test_one_source_draws_exactly_what_it_drew_before_mixtures(mixed):
    """A dataset of one source keeps its order (resumed runs of older versions continue right)."""
    cfg, store, corpus = mixed
    kjv = store.manifest(Ref.parse(corpus.metadata["sources"]["kjv"]))
    blocks = open_split(store, kjv, "train")
    sampler = BlockSampler(blocks, 8, 1, 1, 0, 3)
    sizes, n = np.asarray(blocks.sizes), len(blocks)
    expected = []
    for k in range(40):  # the pre-mixture rule: perm(seed, epoch) over shards, perm(seed, epoch, shard) inside
        order = np.random.default_rng([3, k // n]).permutation(len(sizes))
        ends = np.cumsum(sizes[order])
        visit = int(np.searchsorted(ends, k % n, side="right"))
        shard = int(order[visit])
        perm = np.random.default_rng([3, k // n, shard]).permutation(sizes[shard])
        expected.append((shard, int(perm[k % n - (ends[visit] - sizes[shard])])))
    assert sampler.locate_many(0, 40) == expected


def test_the_sources_are_tokenized_once_each_and_the_weights_change_no_dataset(mixed, tmp_path):
    """The corpus names each source's own dataset version, made with one shared tokenizer;
    other weights plan the same versions, all found in the store (no tokenize work)."""
    cfg, store, corpus = mixed
    refs = corpus.metadata["sources"]
    assert sorted(refs) == ["kjv", "pystdlib"] and sorted(corpus.parents) == sorted(refs.values())
    tokenizers = {store.manifest(Ref("tokenizer", s, Ref.parse(r).version)).parents[0] for s, r in refs.items()}
    assert len(tokenizers) == 1  # one shared tokenizer version, named by both sources' plans
    before = {kind: sorted(str(m.ref) for m in store.ls(kind)) for kind in ("dataset", "shard", "tokenizer")}
    other = OmegaConf.to_object(compose([*MIX, "data.mixture.kjv=0.1", "data.mixture.pystdlib=0.9"]))
    again = run_tokenize(other.data, cfg.tokenizer, cfg.model, store)
    assert again.reused and again.manifest.ref == corpus.ref
    assert {kind: sorted(str(m.ref) for m in store.ls(kind)) for kind in before} == before


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["+data.mixture.web=1.0"], "data.mixture: web not among the sources (kjv, pystdlib)"),
        (["data.mixture.kjv=-0.5"], "data.mixture: weights must be >= 0, got {'kjv': -0.5}"),
        (["data.mixture.kjv=0", "data.mixture.pystdlib=0"], "data.mixture: the weights sum to 0"),
        (["data.name=kjv"], "data.sources: a source is named data.name=kjv"),
    ],
)
def test_a_bad_mixture_fails_at_compose_naming_the_key(overrides, message):
    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(")", r"\)").replace("{", r"\{")):
        compose([*MIX, *overrides])


def test_a_mixture_that_cannot_feed_the_run_is_refused_before_training(mixed):
    from components.mixture import check_mixture_feeds

    cfg, store, corpus = mixed
    kjv = corpus.metadata["stats"]["sources"]["kjv"]["train"]["blocks"]
    capped = OmegaConf.to_object(compose([*MIX, "data.sources.kjv.max_epochs=1.0"]))
    check_mixture_feeds(capped.data, corpus, int(kjv / 0.7) - 100)  # within one pass, the schedule's slack too
    with pytest.raises(DataFitError, match=rf"the run draws about \d+ samples of kjv .* its {kjv} train blocks"):
        check_mixture_feeds(capped.data, corpus, int(kjv / 0.7) + 10)
    assert defaults("data").sources == {}


def test_a_source_with_no_documents_is_refused_at_the_plan_naming_it(tmp_path):
    from components.tokenize.plan import make_plans
    from components.tokenize.sources import DataError

    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    over = [*MIX, f"data.sources.pystdlib.paths=[{empty}]", f"store.root={tmp_path / 'store'}"]
    cfg = OmegaConf.to_object(compose(over))
    store = open_store(cfg.store)
    with pytest.raises(DataError, match=r"^data.sources.pystdlib: no documents: its 1 file\(s\) are empty$"):
        make_plans(cfg.data, cfg.tokenizer, cfg.model, store)
    assert not list(store.ls("tokenizer"))  # refused before any tokenizer was made


SERVE_VAL = """
import sys, time
from pathlib import Path
from components.train.prometheus import Exporter
exporter = Exporter("run1", 0, "node0", Path(sys.argv[1]))
exporter.val({"all": 5.0, "kjv": 4.5, "pystdlib": 6.25})
print(exporter.serve(int(sys.argv[2]), "127.0.0.1"), flush=True)
time.sleep(60)
"""


def test_a_training_serves_each_sources_val_loss_to_prometheus(tmp_path):
    """Point 4: the per-source val losses as a `source`-labelled gauge, scraped over HTTP from the
    process that set them (as Prometheus scrapes a training node)."""
    import subprocess
    import sys
    import urllib.request

    from prometheus_client.parser import text_string_to_metric_families

    from tests.conftest import free_port

    port = free_port()
    proc = subprocess.Popen([sys.executable, "-c", SERVE_VAL, str(tmp_path / "prom"), str(port)], cwd=ROOT,
                            stdout=subprocess.PIPE, text=True)  # fmt: skip
    try:
        url = proc.stdout.readline().strip()
        text = urllib.request.urlopen(url, timeout=10).read().decode()
    finally:
        proc.kill()
        proc.wait()
    served = {
        s.labels["source"]: s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
        if family.name == "liftoff_val_loss"
    }
    assert served == {"all": 5.0, "kjv": 4.5, "pystdlib": 6.25}


@pytest.mark.chaos_slow  # 30-80 s, three runs: in `make chaos`; the sampler's own part runs in make test above
def test_a_two_node_mixture_run_resumed_on_one_node_reads_the_blocks_of_the_uninterrupted_run(trainer):
    """Acceptance 3 with real training processes: 6 steps on 2 nodes, then 1 node (the same global
    batch) seeded with that checkpoint to step 12, read exactly the blocks (hashed from the rows
    handed to the model, by global sample) of an uninterrupted 12-step 2-node run."""
    from components.config import compose as composed
    from tests.faults import injected, read_batches
    from tests.helpers import TWO_NODES

    cfg = trainer.config(*MIX)
    corpus = run_tokenize(cfg.data, cfg.tokenizer, cfg.model, trainer.store).manifest
    assert composed(MIX).data.mixture == {"kjv": 0.7, "pystdlib": 0.3}
    trainer.dataset = str(corpus.ref)
    legs, whole = trainer.tmp / "legs", trainer.tmp / "whole"
    base = [*MIX, "train.checkpoint_interval=6", "train.warmup_steps=2"]
    with injected(record_dir=str(legs)):
        first = trainer.run(*base, *TWO_NODES, "train.micro_batch_size=4", "train.steps=6", data=cfg.data)
        seed = f"train.resume={first.checkpoint_version}"
        trainer.run(*base, "train.micro_batch_size=8", "train.steps=12", seed, data=cfg.data)
    with injected(record_dir=str(whole)):  # another identity (its schedule): a run of its own
        uninterrupted = trainer.run(*base, *TWO_NODES, "train.micro_batch_size=4", "train.steps=12", data=cfg.data)
    got, want = read_batches(legs), read_batches(whole)
    assert sorted(got) == sorted(want) == list(range(12 * 8))  # every position once
    assert got == want  # the same block at each position
    drawn = uninterrupted.model.metadata["mixture"]
    assert drawn["kjv"]["drawn"] + drawn["pystdlib"]["drawn"] == 12 * 8
    source_of = [row["source"] for row in corpus.metadata["shards"]]
    assert {source_of[shard] for ((_, shard),) in want.values()} == {"kjv", "pystdlib"}


def test_a_rolled_back_or_far_jumping_sampler_draws_what_a_fresh_one_does(mixed):
    """A rollback (a spike's rewind) moves the position back; a rank's batches skip the other
    ranks' samples; a micro-batch can outgrow the schedule's window: each answer equals a fresh
    sampler's, asked once at that position."""
    cfg, store, corpus = mixed
    blocks = open_split(store, corpus, "train")
    mix = Mixture.of(blocks, {"kjv": 0.3, "pystdlib": 0.7})
    moving = BlockSampler(blocks, 8, 1, 3, 2, 5, mix)
    for sample in (0, 24, 9000, 48, 240, 12000, 30, 96, 5000, 5000 + 24):
        fresh = BlockSampler(blocks, 8, 1, 3, 2, 5, mix)
        assert moving.indices(sample) == fresh.indices(sample), sample
        assert moving.drawn(sample) == fresh.drawn(sample), sample
    big = BlockSampler(blocks, 5000, 1, 1, 0, 5, mix)  # a micro-batch wider than the window
    assert big.locate_many(100, 5100) == BlockSampler(blocks, 8, 1, 1, 0, 5, mix).locate_many(100, 5100)


def test_a_sources_version_changes_with_its_own_blocks_only(mixed, tmp_path):
    """Another shard count for one source makes that source's blocks, hence its version, anew,
    and keeps the other source's version and the shared tokenizer (a BPE's version is what it
    samples); another filter for one source retrains the tokenizer: every version and the
    corpus's change."""
    from components.tokenize.plan import make_plans

    cfg, store, corpus = mixed
    halves = tmp_path / "pystdlib"
    halves.mkdir()
    lines = (ROOT / "corpus" / "pystdlib.jsonl").read_text().splitlines(keepends=True)
    for i in range(2):
        (halves / f"part{i}.jsonl").write_text("".join(lines[i::2]))
    fresh = [f"store.root={tmp_path / 'store'}", f"store.cache_dir={tmp_path / 'cache'}"]
    versions = []
    for shards in (1, 2):
        over = [*MIX, *fresh, f"data.sources.pystdlib.paths=[{halves}]", f"data.sources.pystdlib.shards={shards}"]
        c = OmegaConf.to_object(compose(over))
        plans, _ = make_plans(c.data, c.tokenizer, c.model, open_store(c.store))
        versions.append({p.dataset.name: (str(p.dataset), p.shared) for p in plans})
    assert versions[0]["kjv"] == versions[1]["kjv"]  # same dataset version, same shared tokenizer
    assert versions[0]["pystdlib"][0] != versions[1]["pystdlib"][0]
    other = OmegaConf.to_object(compose([*MIX, "data.sources.pystdlib.min_chars=20", *fresh[:1]]))
    again = run_tokenize(other.data, other.tokenizer, other.model, store).manifest
    assert again.ref != corpus.ref and set(again.parents).isdisjoint(corpus.parents)


def test_the_preflight_check_bounds_the_schedules_excess_over_long_runs(mixed):
    """At 4.1 M samples a source of weight 0.0403 gets 5 draws more than its share: a cap that
    the share alone would pass is refused, with the schedule's own count as the truth."""
    from types import SimpleNamespace

    from components.mixture import check_mixture_feeds

    cfg, store, corpus = mixed
    weights, n = {"kjv": 0.0403251680058681, "pystdlib": 1 - 0.0403251680058681}, 4_126_647
    blocks = open_split(store, corpus, "train")
    drawn = BlockSampler(blocks, 8, 1, 1, 0, 0, Mixture.of(blocks, weights)).drawn(n)["kjv"]
    assert drawn > math.ceil(weights["kjv"] * n)  # the schedule's excess at this length
    over = [*MIX, f"data.mixture.kjv={weights['kjv']}", f"data.mixture.pystdlib={weights['pystdlib']}"]
    capped = OmegaConf.to_object(compose([*over, "data.sources.kjv.max_epochs=1.0"]))
    stats = {s: {"train": {"blocks": b}} for s, b in (("kjv", drawn - 1), ("pystdlib", n))}
    fake = SimpleNamespace(
        ref=corpus.ref, metadata={"sources": corpus.metadata["sources"], "stats": {"sources": stats}}
    )
    with pytest.raises(DataFitError, match="data.sources.kjv.max_epochs=1"):
        check_mixture_feeds(capped.data, fake, n)


def test_a_run_seeded_with_a_checkpoint_of_other_weights_is_refused(mixed, tmp_path):
    from components.prelaunch import ResumeError, check_inputs

    cfg, store, corpus = mixed
    seed_dir = tmp_path / "seed"
    seed_dir.mkdir()
    (seed_dir / "meta.json").write_text("{}")
    model = {k: v for k, v in OmegaConf.to_container(compose(MIX).model).items() if v is not None}
    meta = {"step": 3, "model": model, "mixture": {"kjv": 0.7, "pystdlib": 0.3}, "max_epochs": {}}
    store.publish("checkpoint", cfg.model.name, "seeded-0.7", seed_dir, metadata=meta)
    other = OmegaConf.to_object(compose([*MIX, "train.resume=seeded-0.7", "data.mixture.kjv=0.5"]))
    args = (corpus, other.model, other.train, other.cluster, store, other.data.cache_gb)
    with pytest.raises(ResumeError, match=r"that run drew its sources by weights \{'kjv': 0.7, 'pystdlib': 0.3\}"):
        check_inputs(*args, data=other.data)
    same = OmegaConf.to_object(compose([*MIX, "train.resume=seeded-0.7"]))
    check_inputs(corpus, same.model, same.train, same.cluster, store, same.data.cache_gb, data=same.data)
