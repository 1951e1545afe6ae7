"""NCCL's environment, read by NCCL's own documented rules, so a setting can be checked
against the devices a node has before a run depends on it (`docs/cluster.md`).

`NCCL_IB_HCA` (NCCL's environment variables page): a comma-separated list of HCA names, each
with an optional `:port`; a leading `^` makes it an exclude list; a leading `=` (after the
`^`, if any) makes the names exact, otherwise each is a prefix. `mlx5` selects `mlx5_0` ...
`mlx5_7`; `=mlx5` selects no device named `mlx5_<n>` and NCCL falls back to TCP sockets."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class HcaFilter:
    exclude: bool
    exact: bool
    names: tuple[tuple[str, int | None], ...]  # (name or prefix, port or None: every port)


def parse_ib_hca(value: str) -> HcaFilter:
    text = value.strip()
    exclude = text.startswith("^")
    text = text[1:] if exclude else text
    exact = text.startswith("=")
    text = text[1:] if exact else text
    names = []
    for token in filter(None, (t.strip() for t in text.split(","))):
        name, _, port = token.partition(":")
        if not name or (port and not port.isdigit()):
            raise ValueError(f"NCCL_IB_HCA={value!r}: {token!r} is not NAME or NAME:PORT")
        names.append((name, int(port) if port else None))
    return HcaFilter(exclude, exact, tuple(names))


def _matches(device: str, name: str, exact: bool) -> bool:
    return device == name if exact else device.startswith(name)


def ib_hcas_used(value: str | None, devices: list[str]) -> list[str]:
    """The devices (HCA names, as under /sys/class/infiniband) NCCL would use with
    NCCL_IB_HCA=`value` (None or empty: every device)."""
    if not value:
        return list(devices)
    f = parse_ib_hca(value)
    hit = [d for d in devices if any(_matches(d, name, f.exact) for name, _ in f.names)]
    return [d for d in devices if d not in hit] if f.exclude else hit
