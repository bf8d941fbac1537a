"""Counting NaN/±Inf values in bytes as they are read, per row.

One rule for "non-finite" (every exponent bit set), used by the health statistics
(`stats_rank`) and by the compose step's guard, which counts the values of every row it
writes while it reads them for their CRC-32 check: no extra pass over the data.
Torch-free: numpy looks at the bits, imported on the first count (the workers that read count; the
process that plans a composition and starts them does without its 60 ms).
"""

from __future__ import annotations

import bisect
from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass

from tailor_tui.formats.dtypes import BY_NAME

# Bits of an IEEE float's exponent, all set for NaN and ±Inf, by dtype (little-endian ints).
EXPONENT = {"float32": ("<u4", 0x7F800000), "bfloat16": ("<u2", 0x7F80), "float16": ("<u2", 0x7C00)}
ITEMSIZE = {name: BY_NAME[name].itemsize for name in EXPONENT}  # the dtypes counted


def count(data, dtype: str = "float32") -> int:
    """NaN/±Inf elements in `data` (bytes of little-endian `dtype` values)."""
    import numpy as np  # (after the first call, a lookup in sys.modules)

    if dtype == "float32" and np.isfinite(np.frombuffer(data, dtype="<f4")).all():
        return 0  # the common case: one test of the values, cheaper than the bit test's two temporaries
    int_type, exponent = EXPONENT[dtype]
    bits = np.frombuffer(data, dtype=int_type)
    return int(np.count_nonzero((bits & exponent) == exponent))


@dataclass(frozen=True)
class Region:
    """`length` bytes at `at` in one file hold values of `row`."""

    at: int
    length: int
    row: str
    dtype: str = "float32"


class Census:
    """Counts, per row, the non-finite values in regions of one file, fed the chunks that are
    read of it (`inspect(offset, chunk)`, in any order; parts outside regions are ignored)."""

    def __init__(self, regions: Iterable[Region]) -> None:
        self.regions = sorted(regions, key=lambda r: r.at)
        self._starts = [r.at for r in self.regions]
        self._ends = [r.at + r.length for r in self.regions]
        phases = {r.at % 4 for r in self.regions}  # the fp32 values of all regions lie at one alignment
        self._phase = phases.pop() if len(phases) == 1 and all(r.dtype == "float32" for r in self.regions) else None
        self.counts: Counter = Counter()

    def inspect(self, offset: int, chunk) -> None:
        end = offset + len(chunk)
        i = max(0, bisect.bisect_right(self._starts, offset) - 1)
        j = bisect.bisect_left(self._starts, end)  # regions i..j-1 may overlap the chunk
        if self._phase is not None and j - i > 1:
            # one look at all the regions' span, gaps between them included: almost always clean; only
            # a chunk where it is not is counted region by region
            a, b = max(self._starts[i], offset), min(max(self._ends[i:j]), end)
            a += (self._phase - a) % 4
            if b <= a or count(chunk[a - offset: a - offset + (b - a) // 4 * 4]) == 0:
                return
        while i < len(self.regions) and self.regions[i].at < end:
            r = self.regions[i]
            a, b = max(r.at, offset), min(r.at + r.length, end)
            if b > a:
                size = ITEMSIZE[r.dtype]
                if (a - r.at) % size or (b - a) % size:
                    raise ValueError(f"a read of {a}..{b} splits a {r.dtype} value of region {r}")
                n = count(chunk[a - offset: b - offset], r.dtype)
                if n:
                    self.counts[r.row] += n
            i += 1
