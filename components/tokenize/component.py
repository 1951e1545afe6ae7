"""KFP components of the tokenize stage: plan -> one shard task per source partition -> merge."""

from kfp import dsl
from kfp.dsl import Artifact, Dataset, Input, Output

from components import STAGE_IMAGE


@dsl.component(base_image=STAGE_IMAGE, install_kfp_package=False)
def tokenize_plan(data: dict, tokenizer: dict, model: dict, store: dict, plan: Output[Artifact]) -> list:
    """Partition the source, make the tokenizer once, publish the plan; returns one item per
    shard (the ParallelFor's items). The `plan` artifact points at the plan in the store."""
    import json
    import logging
    import time

    from components.config import checked_groups
    from components.local_pod import enter_task_directory
    from components.store import open_store
    from components.tokenize.plan import make_plan

    started = time.perf_counter()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    enter_task_directory("tokenize-plan")  # under `liftoff run`: a directory of its own, as its pod would have
    g = checked_groups(data=data, tokenizer=tokenizer, model=model, store=store)  # UI edits checked like the CLI's
    made, stored = make_plan(g["data"], g["tokenizer"], g["model"], open_store(g["store"]))
    print(f"liftoff-stage tokenize-plan compute_s={time.perf_counter() - started:.3f}", flush=True)
    ref = str(made.tokenizer)
    with open(plan.path, "w") as f:
        json.dump({"ref": ref, "dataset": str(made.dataset), "shards": made.shards}, f)
    plan.metadata.update({"ref": ref, "dataset": str(made.dataset), "shards": made.shards, "reused": stored})
    return [{"plan": ref, "index": i} for i in range(made.shards)]


@dsl.component(base_image=STAGE_IMAGE, install_kfp_package=False)
def tokenize_shard(shard: dict, data: dict, store: dict) -> str:
    """Tokenize and pack one source partition; returns its `shard/NAME@VERSION-<i>of<n>`."""
    import logging
    import time

    from components.config import checked_groups
    from components.local_pod import enter_task_directory
    from components.store import open_store
    from components.tokenize.plan import load_plan
    from components.tokenize.shard import run_shard

    started = time.perf_counter()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    index = int(shard["index"])  # KFP hands loop items over as JSON numbers (floats)
    enter_task_directory(f"tokenize-shard-{index}")
    g = checked_groups(data=data, store=store)
    st = open_store(g["store"])
    manifest, _ = run_shard(load_plan(st, shard["plan"]), index, g["data"], st)
    print(f"liftoff-stage tokenize-shard compute_s={time.perf_counter() - started:.3f}", flush=True)
    return str(manifest.ref)


@dsl.component(base_image=STAGE_IMAGE, install_kfp_package=False)
def tokenize_merge(
    shards: list, plan: Input[Artifact], data: dict, tokenizer: dict, store: dict, dataset: Output[Dataset]
) -> str:
    """Publish the dataset version listing every shard; returns `dataset/NAME@VERSION`.

    The artifact holds a pointer (ref.json) to the version in liftoff's store rather than a
    second copy of the blocks; downstream stages read the shards from the store.
    """
    import json
    import logging
    import time

    from components.config import checked_groups
    from components.local_pod import enter_task_directory
    from components.store import open_store
    from components.tokenize.merge import merge_shards
    from components.tokenize.plan import load_plan

    started = time.perf_counter()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    enter_task_directory("tokenize-merge")
    g = checked_groups(data=data, tokenizer=tokenizer, store=store)
    st = open_store(g["store"])
    manifest, reused = merge_shards(load_plan(st, plan.metadata["ref"]), list(shards), g["data"], g["tokenizer"], st)
    print(f"liftoff-stage tokenize-merge compute_s={time.perf_counter() - started:.3f}", flush=True)
    ref = str(manifest.ref)
    stats = manifest.metadata["stats"]
    with open(dataset.path, "w") as f:
        json.dump({"ref": ref, "stats": stats, "reused": reused}, f, indent=2)
    dataset.metadata.update({"version": manifest.ref.version, "ref": ref, "shards": stats["shards"], "reused": reused})
    for split, s in stats["splits"].items():
        dataset.metadata[f"{split}_blocks"] = s["blocks"]
        dataset.metadata[f"{split}_tokens"] = s["tokens"]
    return ref
