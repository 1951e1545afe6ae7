"""Robust outlier scores (median / MAD), shared by preflight's node verdicts and train's
straggler report."""

from __future__ import annotations

import statistics

MAD_TO_SIGMA = 0.6745  # MAD of a normal distribution is 0.6745 sigma
MAD_FLOOR = 0.05  # MAD is floored at 5% of the median: identical peers must not make noise an outlier


def robust_z(value: float, peers: list[float]) -> float:
    """How many robust standard deviations `value` lies above the median of `peers`.

    Leave-one-out: callers pass the *other* members, so with two members one slow node
    is still an outlier (with itself included, median and MAD of two values always make
    both scores 0.67).
    """
    if not peers:
        return 0.0
    med = statistics.median(peers)
    mad = statistics.median(abs(p - med) for p in peers)
    scale = max(mad, MAD_FLOOR * abs(med), 1e-12)
    return MAD_TO_SIGMA * (value - med) / scale


def leave_one_out_z(values: list[float]) -> list[float]:
    return [robust_z(v, values[:i] + values[i + 1 :]) for i, v in enumerate(values)]
