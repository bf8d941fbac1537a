"""The CRC-32 arithmetic the streaming rank writer uses to update zip records (see tailor_tui.crc)."""

import random
import zlib

from tailor_tui import crc


def test_combine_matches_zlib_on_concatenations():
    rng = random.Random(1)
    for _ in range(100):
        a, b = rng.randbytes(rng.randint(0, 5000)), rng.randbytes(rng.randint(0, 5000))
        assert crc.combine(zlib.crc32(a), zlib.crc32(b), len(b)) == zlib.crc32(a + b)


def test_replaced_spans_give_the_crc_of_the_new_bytes():
    rng = random.Random(2)
    for _ in range(50):
        old = rng.randbytes(rng.randint(1, 20000))
        new, value = bytearray(old), zlib.crc32(old)
        at = sorted(rng.sample(range(len(old)), min(6, len(old))))
        for start, stop in zip(at[::2], at[1::2]):
            replacement = bytes(stop - start) if rng.random() < 0.3 else rng.randbytes(stop - start)
            new[start:stop] = replacement
            change = zlib.crc32(old[start:stop]) ^ zlib.crc32(replacement)
            value ^= crc.shift(change, len(old) - stop)
        assert value == zlib.crc32(new)


def test_fast_crc_and_zeros_agree_with_zlib():
    data = random.Random(3).randbytes(3 << 20)
    assert crc.crc32(data) == zlib.crc32(data)
    assert crc.crc32(data[5:], crc.crc32(data[:5])) == zlib.crc32(data)
    assert crc.zeros((2 << 20) + 7) == zlib.crc32(bytes((2 << 20) + 7))


def test_the_c_combine_and_the_python_one_agree():
    # ISA-L's crc32_combine where installed, the pure-Python one otherwise: the same values,
    # offsets past 4 GiB included
    rng = random.Random(4)
    for _ in range(2000):
        a, b, n = rng.getrandbits(32), rng.getrandbits(32), rng.randrange(0, 1 << 42)
        assert crc.combine(a, b, n) == crc.combine_in_python(a, b, n)
        assert crc.shift(a, n) == crc.shift_in_python(a, n)
