"""CRC-32 arithmetic: the new CRC of a zip record after some byte ranges were replaced.

CRC-32 is affine over GF(2): for equal-length messages, crc(a) ^ crc(b) == raw(a ^ b),
where raw is the CRC without the initial and final inversion (linear, and blind to
leading zeros). A record whose spans S_i at offsets p_i were replaced by T_i therefore has

    crc(new) = crc(old) ^ XOR_i shift(crc(S_i) ^ crc(T_i), bytes after the span)

where shift(v, n) appends n zero bytes to a raw CRC (multiplication by x^(8n) mod P,
as zlib's crc32_combine does). So the new CRC needs only the replaced bytes, old and
new: the untouched bytes of the base are never read into user space and can be copied
in the kernel. A corrupt base record stays detectably corrupt (its CRC is carried, not
recomputed over bad bytes).
"""

from __future__ import annotations

from functools import lru_cache
from typing import Callable

_c_combine: Callable[[int, int, int], int] | None
try:  # ISA-L's CRC-32 (carry-less multiply): about 3x zlib's on x86-64 and ARM
    from isal.isal_zlib import crc32
    from isal.isal_zlib import crc32_combine as _c_combine
except ImportError:  # no wheel for this platform: zlib gives the same values, slower
    from zlib import crc32

    _c_combine = None

_POLY = 0xEDB88320  # reflected CRC-32 polynomial
_X0 = 1 << 31  # x^0 in the reflected representation


def _multmodp(a: int, b: int) -> int:
    """a * b mod P (reflected)."""
    product, m = 0, _X0
    while a:
        if a & m:
            product ^= b
            a ^= m
        m >>= 1
        b = (b >> 1) ^ _POLY if b & 1 else b >> 1
    return product


# _X2N[k] = x^(2^k) mod P
_X2N = [1 << 30]
for _ in range(31):
    _X2N.append(_multmodp(_X2N[-1], _X2N[-1]))


@lru_cache(maxsize=1 << 14)  # spans repeat their lengths rank after rank: worked out once each
def _x8nmodp(n: int) -> int:
    """x^(8n) mod P: the operator that appends n zero bytes."""
    p, k = _X0, 3
    while n:
        if n & 1:
            p = _multmodp(_X2N[k & 31], p)
        n >>= 1
        k += 1
    return p


def shift_in_python(raw: int, zero_bytes: int) -> int:
    """`shift` without ISA-L."""
    return _multmodp(_x8nmodp(zero_bytes), raw)


def combine_in_python(crc1: int, crc2: int, len2: int) -> int:
    """`combine` without ISA-L."""
    return shift_in_python(crc1, len2) ^ crc2


def shift(raw: int, zero_bytes: int) -> int:
    """The raw CRC of a message followed by `zero_bytes` zeros."""
    return _c_combine(raw, 0, zero_bytes) if _c_combine else shift_in_python(raw, zero_bytes)


def combine(crc1: int, crc2: int, len2: int) -> int:
    """crc(A + B) from crc(A), crc(B) and len(B) (zlib's crc32_combine; ISA-L's in C where
    installed: a wide run combines hundreds of thousands of slices' CRCs, ~0.5 us each
    against ~6 us in Python)."""
    return _c_combine(crc1, crc2, len2) if _c_combine else combine_in_python(crc1, crc2, len2)


_ZEROS = bytes(1 << 20)


@lru_cache(maxsize=1 << 12)  # padding repeats its lengths part after part, rank after rank
def zeros(n: int) -> int:
    """crc32 of n zero bytes."""
    crc = 0
    while n:
        k = min(n, len(_ZEROS))
        crc = crc32(memoryview(_ZEROS)[:k], crc)
        n -= k
    return crc
