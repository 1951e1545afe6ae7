"""A dataset's sources and the weights a run draws them by, resolved before launch and
checked against what the run will draw (the sampler is `components.train.data`)."""

from __future__ import annotations

import math

from components.config import DataConfig
from components.identity import mixture_identity
from components.prelaunch import DataFitError, ResumeError
from components.store import Manifest


def schedule_slack(samples: int) -> int:
    """How far a source's draws in the first `samples` can exceed weight x samples: the golden
    ratio's Kronecker sequence has discrepancy O(log n) (its partial quotients are all 1: an
    interval's count is within about 1.44 log2 n of its share); twice that, and 3, to spare."""
    return 3 + 2 * math.ceil(math.log2(samples + 2))


def source_refs(dataset: Manifest) -> dict[str, str]:
    """{source: its dataset version} of a mixture's corpus; {} for a dataset of one source."""
    return dict(dataset.metadata.get("sources") or {})


def source_blocks(dataset: Manifest, split: str = "train") -> dict[str, int]:
    """Each source's blocks in `split` (a mixture's corpus)."""
    per = dataset.metadata["stats"].get("sources", {})
    return {name: int(per[name][split]["blocks"]) for name in source_refs(dataset)}


def draw_weights(data: DataConfig, dataset: Manifest) -> dict[str, float]:
    """The normalised weight of each source of the dataset ({} for one source): data.mixture's,
    or by default each source's share of the train blocks. The dataset must hold exactly the
    sources data.sources names."""
    refs = source_refs(dataset)
    if not refs:
        extra = set(data.mixture) - {dataset.ref.name}
        if data.sources or extra:
            raise DataFitError(
                f"data.mixture/data.sources name {sorted(extra or data.sources)}, but {dataset.ref} is one source"
            )
        return {}
    if sorted(refs) != data.source_names:
        raise DataFitError(f"{dataset.ref} holds sources {sorted(refs)}, data.sources names {data.source_names}")
    return data.weights(source_blocks(dataset))


def max_epochs(data: DataConfig) -> dict[str, float]:
    """The sources' caps on passes over their train blocks (the capped ones only)."""
    return {name: src.max_epochs for name, src in data.sources.items() if src.max_epochs is not None}


def identity_of(data: DataConfig, dataset: Manifest) -> dict:
    """What of a mixture enters the training identity (`components.identity.mixture_identity`)."""
    return mixture_identity(draw_weights(data, dataset), max_epochs(data))


def trained_weights(model: Manifest) -> dict[str, float]:
    """The weights a model's run drew its sources by ({} for one source), from its metadata."""
    return {name: m["weight"] for name, m in model.metadata.get("mixture", {}).items()}


def check_seed_mixture(seed: dict, data: DataConfig, dataset: Manifest, where: str) -> None:
    """A seeded run continues the seed's sample order, which a mixture's weights and caps decide
    from sample 0: other weights would reread some blocks and skip others, so they are refused."""

    def rounded(w: dict) -> dict:
        return {k: round(float(v), 9) for k, v in w.items()}

    ours = (rounded(draw_weights(data, dataset)), max_epochs(data))
    theirs = (rounded(seed.get("mixture", {})), seed.get("max_epochs", {}))
    if ours != theirs:
        raise ResumeError(
            f"{where}: that run drew its sources by weights {theirs[0] or 'none (one source)'} and caps "
            f"{theirs[1] or 'none'}, this one by {ours[0] or 'none (one source)'} and {ours[1] or 'none'}: a "
            "seeded run continues the seed's sample order, which the weights decide from its first sample; "
            "train with the seed's weights, or from scratch"
        )


def check_mixture_feeds(data: DataConfig, dataset: Manifest, samples: int) -> None:
    """Refuse a mixture that cannot feed `samples` draws: a weighed source with no train blocks,
    or one that its max_epochs cap would run out of. The numbers are in the message."""
    weights = draw_weights(data, dataset)
    blocks, caps = source_blocks(dataset), max_epochs(data)
    for name, w in weights.items():
        if w <= 0:
            continue
        need = min(samples, math.ceil(w * samples) + schedule_slack(samples))
        if blocks[name] == 0:
            raise DataFitError(f"data.mixture: source {name} has weight {w:.3g} but no train blocks")
        if name in caps and need > caps[name] * blocks[name]:
            raise DataFitError(
                f"data.sources.{name}.max_epochs={caps[name]:g}: the run draws about {need} samples of {name} "
                f"(weight {w:.3g} x {samples} samples), more than {caps[name]:g} x its {blocks[name]} train blocks"
                f" = {int(caps[name] * blocks[name])}; lower its weight, raise max_epochs or train fewer steps"
            )
