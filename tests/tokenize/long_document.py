"""Child process of tests/tokenize/test_long_documents.py: one corpus through the whole
tokenize stage (plan with its BPE training, shard, merge), then one JSON line on stdout:
this process's peak RSS read right after the stage, and what the first train document
became (its token count, a decoded prefix).

    python -m tests.tokenize.long_document CORPUS WORKDIR [OVERRIDE ...]
"""

from __future__ import annotations

import json
import resource
import sys
import time


def main(corpus: str, work: str, *overrides: str) -> None:
    import numpy as np
    import pyarrow as pa
    from omegaconf import OmegaConf

    from components.blocks import load_tokenizer
    from components.config import compose, defaults
    from components.store import Ref, open_store
    from components.tokenize.stage import run_tokenize

    cfg = OmegaConf.to_object(compose([f"data.paths=[{corpus}]", *overrides]))
    store = open_store(defaults("store", root=f"{work}/store", cache_dir=f"{work}/cache"))
    t0 = time.perf_counter()
    result = run_tokenize(cfg.data, cfg.tokenizer, cfg.model, store)
    seconds = time.perf_counter() - t0
    peak_mb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB on Linux

    (shard,) = result.manifest.metadata["shards"]
    arrow = store.fetch(Ref.parse(shard["ref"])) / "train.arrow"
    column = pa.ipc.open_stream(pa.memory_map(str(arrow))).read_all().column("input_ids").combine_chunks()
    ids = column.flatten().to_numpy()
    tok = load_tokenizer(store.fetch(result.manifest))
    first = int(np.flatnonzero(ids == tok.eos_token_id)[0])  # the first document ends at the first EOS
    report = {
        "peak_rss_mb": round(peak_mb),
        "seconds": round(seconds, 1),
        "first_doc_tokens": first,
        "first_doc_prefix": tok.decode(ids[:200].tolist()),
        "train_tokens": result.stats["splits"]["train"]["tokens"],
    }
    print(json.dumps(report))


if __name__ == "__main__":
    main(*sys.argv[1:])
