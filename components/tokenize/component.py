"""KFP component `tokenize`: config groups in, a dataset version out."""

from kfp import dsl
from kfp.dsl import Dataset, Output

from components import STAGE_IMAGE


@dsl.component(base_image=STAGE_IMAGE, install_kfp_package=False)
def tokenize(data: dict, tokenizer: dict, model: dict, store: dict, dataset: Output[Dataset]) -> str:
    """Tokenize and pack the corpus; returns the dataset reference `dataset/NAME@VERSION`.

    The artifact holds a pointer (ref.json) to the version in liftoff's store rather
    than a second copy of the blocks; downstream stages fetch it (cached, verified).
    """
    import json
    import logging
    import time

    from components.config import checked_groups
    from components.store import open_store
    from components.tokenize.stage import run_tokenize

    started = time.perf_counter()  # the stage's own work, after its imports (those are overhead)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    from components.local_pod import enter_task_directory

    enter_task_directory("tokenize")  # under `liftoff run`: a directory of its own, as its pod would have
    g = checked_groups(data=data, tokenizer=tokenizer, model=model, store=store)  # UI edits checked like the CLI's
    result = run_tokenize(
        g["data"],
        g["tokenizer"],
        g["model"],
        open_store(g["store"]),
    )
    print(f"liftoff-stage tokenize compute_s={time.perf_counter() - started:.3f}", flush=True)
    ref = str(result.manifest.ref)
    with open(dataset.path, "w") as f:
        json.dump({"ref": ref, "stats": result.stats, "reused": result.reused}, f, indent=2)
    dataset.metadata.update({"version": result.manifest.ref.version, "ref": ref, "reused": result.reused})
    for split, s in result.stats["splits"].items():
        dataset.metadata[f"{split}_blocks"] = s["blocks"]
        dataset.metadata[f"{split}_tokens"] = s["tokens"]
    return ref
