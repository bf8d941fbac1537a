"""How tailor-tui shows sizes and progress: one way everywhere (plan, CLI, bars, composer)."""

from __future__ import annotations

import humanize


def size(n: float) -> str:
    """Bytes, binary units: `1.4 GiB`."""
    return humanize.naturalsize(n, binary=True, format="%.1f")


def throughput(done: float, total: float, elapsed: float) -> tuple[float, float]:
    """(bytes per second so far, seconds left at that rate) of `done` of `total` bytes."""
    rate = done / max(elapsed, 1e-6)
    return rate, (total - done) / rate if rate > 0 else 0.0
