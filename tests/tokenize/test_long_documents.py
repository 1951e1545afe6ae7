"""A very long document tokenizes in bounded memory, to the ids of the whole text.

The acceptance case: a 50 MB single-line JSONL document (data.max_doc_bytes admits 64 MiB)
through the whole tokenize stage (the plan's BPE trains on it too) in a child process,
which reports its own peak RSS: under 2 GiB (0.8 GB measured; unchunked it was 12.7 GB,
and an 8 MB line alone took 1.6 GB). ~22 s on 2 cores, so `make test` runs a 16 MB line (which
unchunked took 2.7 GB) and `make chaos` the 50 MB one.
"""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys

import numpy as np
import pytest

from components.config import defaults
from components.tokenize import pack
from components.tokenize.documents import document_keys
from components.tokenize.pack import pieces, token_shards
from components.tokenize.tokenizer import train_bpe
from tests.conftest import CORPUS, ROOT


def kjv() -> list[str]:
    return [json.loads(line)["text"] for line in CORPUS.read_text().splitlines()]


@pytest.fixture(scope="module")
def bpe():
    """The BPE the stage trains on the shipped corpus (its backend `tokenizers.Tokenizer`)."""
    return train_bpe(iter(kjv()), defaults("tokenizer"))


def one_line_corpus(tmp_path, mb: int) -> tuple[object, str, str, int]:
    """A JSONL corpus whose first line is one document of ~`mb` MB: a salt, then `unit` (the
    shipped corpus on one line, after a space) repeated; the salt puts it in the train split.
    Then the shipped documents, so the val split has blocks. Returns (path, salt, unit, repeats)."""
    unit = " " + " ".join(kjv())
    repeats = (mb << 20) // len(unit)
    salt = 0
    while document_keys({"text": [f"{salt}{unit * repeats}"]}, 1, 0)["draw"][0] < defaults("data").val_fraction:
        salt += 1
    src = tmp_path / "corpus.jsonl"
    with open(src, "w") as f:
        f.write(json.dumps({"text": f"{salt}{unit * repeats}"}) + "\n")
        for text in kjv():
            f.write(json.dumps({"text": text}) + "\n")
    return src, str(salt), unit, repeats


def tokenize_in_a_child(tmp_path, corpus) -> dict:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "HF_DATASETS_CACHE": str(tmp_path / "hf")}
    proc = subprocess.run(
        [sys.executable, "-m", "tests.tokenize.long_document", str(corpus), str(tmp_path / "work")],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=900,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def check_long_document(tmp_path, mb: int, budget_mb: int) -> dict:
    corpus, salt, unit, repeats = one_line_corpus(tmp_path, mb)
    got = tokenize_in_a_child(tmp_path, corpus)
    assert got["peak_rss_mb"] < budget_mb, got
    # The expected count comes from encoding small strings on their own: a byte-level BPE's
    # pre-tokenizer splits before each " " that follows a word, so the document's ids are the
    # salt's, then the unit's `repeats` times. The stage trained its own BPE: load it.
    from components.blocks import load_tokenizer
    from components.store import open_store

    store = open_store(defaults("store", root=str(tmp_path / "work/store"), cache_dir=str(tmp_path / "work/cache")))
    (dataset,) = store.ls("dataset")
    tok = load_tokenizer(store.fetch(dataset.ref)).backend_tokenizer
    count = lambda text: len(tok.encode(text, add_special_tokens=False).ids)  # noqa: E731
    n = count(salt) + repeats * count(unit)
    assert got["first_doc_tokens"] == n
    assert got["first_doc_prefix"] and f"{salt}{unit}".startswith(got["first_doc_prefix"])
    return got


@pytest.mark.parametrize(
    "mb", [16, pytest.param(50, marks=pytest.mark.chaos_slow)]
)  # 16 MB unchunked took 2.7 GB; the 50 MB acceptance case is in `make chaos`
def test_a_long_line_tokenizes_in_under_2gib(tmp_path, mb):
    got = check_long_document(tmp_path, mb, budget_mb=2048)
    print(f"{mb} MB line: peak RSS {got['peak_rss_mb']} MB, {got['seconds']} s")


def test_pieces_join_back_and_cut_before_a_space_after_a_word():
    text = " ".join(kjv()[:50])
    got = list(pieces(text, 100))
    assert "".join(got) == text and len(got) > 50 and all(len(p) <= 100 for p in got)
    assert all(not a[-1].isspace() and b.startswith(" ") for a, b in zip(got, got[1:], strict=False))
    assert list(pieces("ab   cd ef", 6)) == ["ab", "   cd", " ef"]  # before the run of spaces, not inside
    assert list(pieces("x" * 25, 10)) == ["x" * 10, "x" * 10, "x" * 5]  # no space: hard cuts
    assert list(pieces("short", 10)) == ["short"] and list(pieces("", 10)) == [""]


def test_pieces_encode_to_the_whole_texts_ids(bpe):
    """Random texts of words, runs of spaces, newlines, digits, punctuation and non-ASCII:
    wherever no hard cut was needed, the pieces' ids are the whole text's."""
    tok = bpe.backend_tokenizer
    rng = random.Random(0)
    alphabet = [*"ab cd  \n\t\r.,;'s 12345 é日本語 \u00a0\u3000 !?-—\"", "'ll", "  ", "\n\n", " \n", "\n "]
    checked = 0
    for _ in range(2000):
        text = "".join(rng.choice(alphabet) for _ in range(rng.randint(0, 200)))
        got = list(pieces(text, rng.choice([16, 40, 80])))
        if any(not (b.startswith(" ") and a[-1:] and not a[-1].isspace()) for a, b in zip(got, got[1:], strict=False)):
            continue  # a hard cut: exact only up to it
        whole = tok.encode(text, add_special_tokens=False).ids
        assert [i for p in got for i in tok.encode(p, add_special_tokens=False).ids] == whole, repr(text)
        checked += 1
    assert checked > 1000, checked


def test_chunked_encoding_gives_the_unchunked_token_stream(bpe, monkeypatch):
    """token_shards over documents longer than a piece, with tiny pieces and batches, yields
    the very ids the unchunked encoding does (the stage's own code path, one process)."""
    import datasets

    texts = kjv()[:20] + [" ".join(kjv()[i : i + 5]) for i in range(20, 60, 5)] + ["", "a"]
    docs = datasets.Dataset.from_dict({"text": texts})
    dtype = np.dtype(np.uint16)

    def stream() -> tuple[np.ndarray, int]:
        out = list(token_shards(docs, bpe, dtype, 1))
        return np.concatenate([a for a, _ in out]), sum(e for _, e in out)

    monkeypatch.setattr(pack, "PIECE_CHARS", 1 << 40)
    monkeypatch.setattr(pack, "ENCODE_BATCH_CHARS", 1 << 40)
    whole, empty = stream()
    monkeypatch.setattr(pack, "PIECE_CHARS", 200)
    monkeypatch.setattr(pack, "ENCODE_BATCH_CHARS", 500)
    chunked, chunked_empty = stream()
    np.testing.assert_array_equal(chunked, whole)
    assert empty == chunked_empty == 1 and (whole == bpe.eos_token_id).sum() == len(docs) - 1
