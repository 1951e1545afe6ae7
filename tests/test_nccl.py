"""Issue 42, acceptance 1: every NCCL_IB_HCA the guide and the presets ship selects the
HCAs of an 8-NIC node (mlx5_0 ... mlx5_7) by NCCL's documented rules; `=mlx5` (exact
names) selected none and NCCL fell back to TCP sockets."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from components.nccl import ib_hcas_used

ROOT = Path(__file__).resolve().parent.parent
HCAS = [f"mlx5_{i}" for i in range(8)]
SETTING = re.compile(r"NCCL_IB_HCA[:=]\s*'?([^,'}`\s]+)")


@pytest.mark.parametrize(
    "value, used",
    [
        ("mlx5", HCAS),
        ("mlx5_0:1,mlx5_1:1", ["mlx5_0", "mlx5_1"]),
        ("=mlx5", []),
        ("=mlx5_0:1,mlx5_3", ["mlx5_0", "mlx5_3"]),
        ("^=mlx5_1,mlx5_4", ["mlx5_0", "mlx5_2", "mlx5_3", "mlx5_5", "mlx5_6", "mlx5_7"]),
        ("^mlx5", []),
        ("", HCAS),
    ],
)
def test_the_rules_are_nccls_documented_ones(value, used):
    assert ib_hcas_used(value, HCAS) == used


def _shipped() -> list[tuple[str, str]]:
    files = [ROOT / "deploy" / "README.md", ROOT / "docs" / "cluster.md"]
    files += sorted((ROOT / "conf" / "cluster").glob("*.yaml")) + sorted((ROOT / "conf" / "experiment").glob("*.yaml"))
    return [(p.relative_to(ROOT).as_posix(), m) for p in files for m in SETTING.findall(p.read_text())]


def test_every_shipped_hca_setting_selects_every_mlx5_hca():
    shipped = _shipped()
    assert any(where == "deploy/README.md" for where, _ in shipped), "the guide sets NCCL_IB_HCA"
    for where, value in shipped:
        assert ib_hcas_used(value, HCAS) == HCAS, f"{where}: NCCL_IB_HCA={value} selects {ib_hcas_used(value, HCAS)}"
