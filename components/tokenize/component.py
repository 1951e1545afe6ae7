"""KFP components of the tokenize stage: plan -> one shard task per source partition -> merge."""

from kfp import dsl
from kfp.dsl import Artifact, Dataset, Input, Output

from components import STAGE_IMAGE


@dsl.component(base_image=STAGE_IMAGE, install_kfp_package=False)
def tokenize_plan(data: dict, tokenizer: dict, model: dict, store: dict, plan: Output[Artifact]) -> list:
    """Partition each source, make the tokenizer once, publish the plans; returns one item per
    shard of every source (the ParallelFor's items), each carrying its source's data group. The
    `plan` artifact points at the plans in the store."""
    import json

    from components.config import as_plain_dict, drop_none
    from components.store.keys import utc_now
    from components.task import stage_task
    from components.tokenize.plan import make_plans, shard_items

    with stage_task("tokenize-plan", data=data, tokenizer=tokenizer, model=model, store=store) as task:
        began = utc_now()
        g = task.groups
        made, stored = make_plans(g["data"], g["tokenizer"], g["model"], task.store)
        refs = [str(p.tokenizer) for p in made]
        shards = sum(p.shards for p in made)
        with open(plan.path, "w") as f:
            json.dump({"refs": refs, "datasets": [str(p.dataset) for p in made], "shards": shards}, f)
        plan.metadata.update({"ref": refs[0], "refs": refs, "shards": shards, "reused": stored})
        items = []
        for p in made:
            source = drop_none(as_plain_dict(g["data"].source(p.dataset.name)))
            items += shard_items(p, task.store, began, source)
    return items


@dsl.component(base_image=STAGE_IMAGE, install_kfp_package=False)
def tokenize_shard(shard: dict, store: dict) -> str:
    """Tokenize and pack one source partition; returns its `shard/NAME@VERSION-<i>of<n>`. Its
    data group is its source's, from the item (the mixture's weights are not in it)."""

    from components.task import stage_task
    from components.tokenize.plan import load_plan
    from components.tokenize.shard import run_shard

    directory = f"tokenize-shard-{int(shard['index'])}"  # KFP hands loop items over as JSON numbers (floats)
    with stage_task("tokenize-shard", directory, data=shard["data"], store=store) as task:
        index = int(shard["index"])
        manifest, _ = run_shard(load_plan(task.store, shard["plan"]), index, task.groups["data"], task.store)
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

    from components import summaries
    from components.task import stage_task
    from components.tokenize.merge import merge_all
    from components.tokenize.plan import load_plan

    with stage_task("tokenize-merge", data=data, tokenizer=tokenizer, store=store) as task:
        g, st = task.groups, task.store
        plans = [load_plan(st, r) for r in plan.metadata.get("refs") or [plan.metadata["ref"]]]
        manifest, reused = merge_all(plans, list(shards), g["data"], g["tokenizer"], st)
        ref = str(manifest.ref)
        stats = manifest.metadata["stats"]
        with open(dataset.path, "w") as f:
            json.dump({"ref": ref, "stats": stats, "reused": reused}, f, indent=2)
        dataset.metadata.update(
            {"version": manifest.ref.version, "ref": ref, "shards": stats["shards"], "reused": reused}
        )
        for split, s in stats["splits"].items():
            dataset.metadata[f"{split}_blocks"] = s["blocks"]
            dataset.metadata[f"{split}_tokens"] = s["tokens"]
        blocks = {split: s["blocks"] for split, s in stats["splits"].items()}
        summaries.attach(dataset, summaries.TokenizeSummary(ref, blocks.get("train", 0), blocks.get("val", 0), reused))
    return ref
