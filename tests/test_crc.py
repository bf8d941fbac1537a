"""The CRC-32 arithmetic the streaming rank writer uses to update zip records (see tailor_tui.checked.crc)."""

import random
import zlib

from tailor_tui.checked import crc


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
        assert crc.combine(0, b, n) == b == crc.combine_in_python(0, b, n)  # (joined to a CRC-32 of 0: itself)


def test_a_record_read_in_chunks_gives_every_range_its_crc_and_checks_the_whole(tmp_path):
    """checked.evidence.checked_crcs reads a record in chunks of its buffer whatever the ranges (empty ones,
    neighbours, ranges across chunks, at either end); each range's CRC and the record's check come
    out as zlib gives them, every byte is seen once, and one flipped byte fails the check."""
    import os

    import pytest

    from tailor_tui.checked.evidence import checked_crcs
    from tailor_tui.errors import CheckpointError
    from tailor_tui.formats.ptfile import Record

    rng = random.Random(4)
    data = rng.randbytes(40_000)
    path = tmp_path / "file"
    path.write_bytes(data)
    fd = os.open(path, os.O_RDONLY)
    try:
        for trial in range(300):
            start = rng.randrange(0, 1000)
            size = rng.choice([0, 1, rng.randrange(1, 39_000 - start)])
            cuts = sorted(rng.choice([start, start + size, rng.randint(start, start + size)])
                          for _ in range(2 * rng.randint(0, 6)))
            ranges = list(zip(cuts[::2], [b - a for a, b in zip(cuts[::2], cuts[1::2])]))
            flip = trial % 5 == 0 and size > 0
            stored = zlib.crc32(data[start: start + size]) ^ (1 if flip else 0)
            record = Record("archive/data/0", 0, start, size, stored, ())
            seen = []
            buffer = memoryview(bytearray(rng.choice([7, 100, 4096, 65536])))
            if flip:
                with pytest.raises(CheckpointError, match="fails its CRC-32 check"):
                    checked_crcs(fd, path, record, ranges, buffer)
                continue
            found = checked_crcs(fd, path, record, ranges, buffer, inspect=lambda o, c, seen=seen: seen.append((o, bytes(c))))
            assert found == [zlib.crc32(data[a: a + n]) for a, n in ranges]
            assert b"".join(c for _o, c in seen) == data[start: start + size]
            assert [o for o, _c in seen] == sorted(o for o, _c in seen)
    finally:
        os.close(fd)


def test_padding_that_is_not_zero_is_found_with_its_crc_whatever_the_chunks():
    """rank_stream.Padding, fed a file's bytes in chunks of every size: it finds exactly the pads that
    hold a non-zero byte, each with the CRC-32 of its bytes (parts in several chunks)."""
    from tailor_tui.compose.rank_stream import Padding

    rng = random.Random(5)
    for _ in range(200):
        data = bytearray(rng.randbytes(5000))
        pads, at = [], rng.randrange(50)
        while at < 4900:
            n = rng.randint(1, 300)
            n = min(n, 5000 - at)
            dirty = rng.random() < 0.3
            data[at: at + n] = bytes(n)
            if dirty:
                data[at + rng.randrange(n)] = rng.randint(1, 255)
            pads.append((at, n, None))
            at += n + rng.randint(0, 200)
        padding = Padding(pads)
        offset, step = 0, rng.choice([1, 7, 64, 999, 5000])
        while offset < len(data):
            padding.inspect(offset, memoryview(data)[offset: offset + step])
            offset += step
        want = [(a, n, None, zlib.crc32(data[a: a + n])) for a, n, _r in pads if any(data[a: a + n])]
        assert padding.found() == want
