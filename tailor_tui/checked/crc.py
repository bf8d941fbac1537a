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

import struct
from functools import lru_cache
from typing import Callable, NamedTuple

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
    against ~6 us in Python). crc(A) 0 (A empty, as where a row's first part is joined to nothing): crc(B) itself, as
    the arithmetic gives (0 shifted is 0), without it."""
    if not crc1:
        return crc2
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


# --- the CRC-32s of a record's blocks ------------------------------------------------------------
#
# A pass that reads a record whole to check its CRC-32 (the health statistics) also records the
# CRC-32 of each block of its data (BLOCK bytes; tests make them smaller, their records being
# smaller than that), from the data's first byte (the last block shorter).
# A later reader that needs only some of the record's bytes (a cloned composition takes a few rows
# from a source) reads just the blocks that cover them and checks each against its recorded value:
# a byte the output takes is still one that was checked, without the rest of the record being read.

BLOCK = 1 << 20
BLOCK_SIZES = range(10, 27)  # the powers of two a block may be (1 KiB .. 64 MiB): whole 4-byte values


def block_count(size: int, block: int) -> int:
    """How many blocks of `block` bytes `size` bytes of data make."""
    return -(-size // block)


class BlockCrcs:
    """The CRC-32 of a stretch of bytes fed in order (`feed`), and of each `block`-byte block of it:
    every byte goes through crc32 once (into its block's value), and the stretch's value is the
    blocks' combined (one `combine` a block), so recording the blocks costs a reader that checks
    the whole anyway next to nothing."""

    def __init__(self, block: int = BLOCK) -> None:
        self.block = block
        self.values: list[int] = []  # the blocks completed so far
        self.whole = 0  # the CRC-32 of those blocks, combined
        self._value, self._filled = 0, 0  # the block being fed

    def feed(self, view) -> None:
        at, n = 0, len(view)
        while at < n:
            k = min(self.block - self._filled, n - at)
            self._value = crc32(view[at: at + k], self._value)
            self._filled += k
            at += k
            if self._filled == self.block:
                self._close()

    def finish(self) -> int:
        """The whole stretch's CRC-32, once every byte was fed (its last, shorter block closed)."""
        if self._filled:
            self._close()
        return self.whole

    def _close(self) -> None:
        self.whole = combine(self.whole, self._value, self._filled)
        self.values.append(self._value)
        self._value, self._filled = 0, 0


class RecordBlocks(NamedTuple):
    """The block CRC-32s (`BlockCrcs`) of one zip record's data, as a pass that checked the record
    whole against the CRC-32 its archive declares found them: which record (its name, where its
    data lies, its size, that declared CRC-32: a reader uses them only for a record that is still
    all of these), the block size, and the values, 4 bytes each, little-endian (compact to pickle
    and to cache)."""

    name: str
    data_offset: int
    size: int
    crc: int
    block: int
    values: bytes

    @classmethod
    def of(cls, record, blocks: BlockCrcs) -> "RecordBlocks":
        """`record`'s (a `ptfile.Record`), from what `blocks` found of all of its data."""
        return cls(record.name, record.data_offset, record.size, record.crc, blocks.block,
                   struct.pack(f"<{len(blocks.values)}I", *blocks.values))

    def well_formed(self) -> bool:
        """Whether the block size is one of BLOCK_SIZES and the values are as many as the record's
        blocks (what a cache entry claims is checked)."""
        return (self.block.bit_length() - 1 in BLOCK_SIZES and self.block & (self.block - 1) == 0
                and len(self.values) == 4 * block_count(self.size, self.block))

    def describes(self, record) -> bool:
        """Whether these are the blocks of `record` (a `ptfile.Record`) as it is laid out now."""
        return (self.name, self.data_offset, self.size, self.crc) == (
            record.name, record.data_offset, record.size, record.crc) and self.well_formed()

    def value(self, i: int) -> int:
        """The recorded CRC-32 of block `i`."""
        return struct.unpack_from("<I", self.values, 4 * i)[0]

    def span(self, i: int) -> tuple[int, int]:
        """Where block `i` lies in the file: its first byte and the byte after its last."""
        a = self.data_offset + i * self.block
        return a, min(a + self.block, self.data_offset + self.size)

    def covering(self, at: int, n: int) -> range:
        """The blocks that hold the `n` bytes at `at` of the file (none where `n` is 0)."""
        if not n:
            return range(0)
        return range((at - self.data_offset) // self.block, (at + n - 1 - self.data_offset) // self.block + 1)

    def combined(self) -> int:
        """The blocks' values combined: the record's CRC-32, if they are its blocks'."""
        whole = 0
        for i in range(block_count(self.size, self.block)):
            a, b = self.span(i)
            whole = combine(whole, self.value(i), b - a)
        return whole
