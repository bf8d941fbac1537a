"""Reading bytes: exact reads, chunks of a range through one reused buffer and their CRC-32s
(`crc_range`, `RangeCrcs`: one pass gives a stretch's CRC-32 and those of the ranges inside it),
and readahead for a sequential reader."""

from __future__ import annotations

import bisect
import contextlib
import errno
import os
from typing import Callable

from tailor_tui.checked import crc


def pread_exact(fd: int, count: int, offset: int) -> bytes:
    """Read exactly `count` bytes at `offset` (pread may return less on some file systems)."""
    parts, done = [], 0
    while done < count:
        chunk = os.pread(fd, count - done, offset + done)
        if not chunk:
            raise OSError(errno.EIO, f"file ended {count - done} bytes early (truncated?)")
        parts.append(chunk)
        done += len(chunk)
    return parts[0] if len(parts) == 1 else b"".join(parts)


def pread_into(fd: int, view: memoryview, offset: int) -> None:
    """Fill `view` from `offset` (no new buffer per read)."""
    done = 0
    while done < len(view):
        n = os.preadv(fd, [view[done:]], offset + done)
        if n == 0:
            raise OSError(errno.EIO, f"file ended {len(view) - done} bytes early (truncated?)")
        done += n


class Window:
    """Small reads of one file through one reused buffer: a read inside what the previous one
    brought costs no system call (a zip archive's local headers, one per record, hundreds of
    them side by side in a model_states file: one read instead of one each)."""

    def __init__(self, fd: int, size: int = 1 << 16):
        self.fd, self.buffer = fd, bytearray(size)
        self.at, self.filled = 0, 0

    def read(self, offset: int, length: int) -> bytes:
        """Up to `length` bytes at `offset` (fewer only where the file ends)."""
        if length > len(self.buffer):
            return os.pread(self.fd, length, offset)
        return bytes(self.view(offset, length))

    def view(self, offset: int, length: int) -> memoryview:
        """Up to `length` (at most the buffer's size) bytes at `offset`, in the buffer: valid until
        the next call."""
        if not (self.at <= offset and offset + length <= self.at + self.filled):
            self.filled, self.at = os.preadv(self.fd, [self.buffer], offset), offset
        start = offset - self.at
        return memoryview(self.buffer)[start: start + length]


# Bytes per read of every streaming reader (the writers', the verifier's), through one reused buffer: a buffer
# that fits a core's cache is still there when its bytes are checked (CRC-32, memcmp) or written. On this kind of VM
# (2 MiB of L2 a core) fresh 64 MiB buffers ran at 0.6 GiB/s (page faults on every chunk), and the verifier's 4 MiB
# ones took 1.12x the time of 1 MiB ones on the bench checkpoint (its bytes evicted between the read and the check).
READ_CHUNK = 1 << 20
READAHEAD = 16 << 20
SMALLEST_ADVISED = 256 << 10  # a read of less is left to the kernel's own readahead (advice per record would cost
# a system call each: a wide run's records are a few hundred bytes)


class Readahead:
    """Keeps the kernel reading up to `window` bytes ahead of a sequential reader of `fd`
    (POSIX_FADV_WILLNEED: asynchronous, into the page cache, nothing held by this process),
    so the disk works while the reader computes on what it has."""

    def __init__(self, fd: int, window: int = READAHEAD):
        self.fd, self.window, self.ahead = fd, window, 0

    def before(self, position: int, end: int) -> None:
        """About to read from `position` of a range that ends at `end`."""
        if end - position < SMALLEST_ADVISED:
            return
        if self.ahead < position or self.ahead > end:
            self.ahead = position
        if self.ahead - position <= self.window // 2 and self.ahead < end:
            stop = min(end, position + self.window)
            with contextlib.suppress(OSError, AttributeError):  # advice only: never fatal
                os.posix_fadvise(self.fd, self.ahead, stop - self.ahead, os.POSIX_FADV_WILLNEED)
            self.ahead = stop


def crc_range(fd: int, offset: int, length: int, buffer: memoryview, *,
              on_bytes: Callable[[int], None] = lambda n: None,
              inspect: Callable[[int, memoryview], None] | None = None) -> int:
    """CRC-32 of a byte range of a file, read through `buffer` (reused: no allocation per read);
    `inspect(offset, chunk)` sees every chunk read (the compose step counts non-finite values so)."""
    value, end = 0, offset + length
    while offset < end:
        view = buffer[: min(len(buffer), end - offset)]
        pread_into(fd, view, offset)
        value = crc.crc32(view, value)
        if inspect is not None:
            inspect(offset, view)
        offset += len(view)
        on_bytes(len(view))
    return value


class RangeCrcs:
    """The CRC-32 of the stretch [start, end) of a file and of each byte range (offset, length)
    inside it, as the stretch's bytes are fed in order (`feed`): one pass gives a record's CRC
    to check and those of the ranges a writer replaces or takes. `ranges` are sorted, disjoint
    and inside the stretch."""

    def __init__(self, start: int, end: int, ranges: list[tuple[int, int]]):
        position = start
        for at, n in ranges:
            if not (position <= at and at + n <= end):
                raise ValueError(f"range {at}+{n} is outside {start}..{end} or out of order")
            position = at + n
        self.position, self.end, self.ranges = start, end, ranges
        self.whole, self.found, self._i = 0, [0] * len(ranges), 0  # _i: the first range not fed to its end

    def feed(self, view: memoryview) -> None:
        """The stretch's next bytes."""
        ranges, found, i = self.ranges, self.found, self._i
        offset = self.position
        stop, at = offset + len(view), offset
        if stop > self.end:
            raise ValueError(f"{stop - self.end} bytes fed past the end of {self.end}")
        while at < stop or (i < len(ranges) and ranges[i][0] == at and ranges[i][1] == 0):
            if i < len(ranges) and ranges[i][0] <= at:  # in range i: its CRC and the stretch's
                last = min(stop, ranges[i][0] + ranges[i][1])
                value = crc.crc32(view[at - offset: last - offset])
                self.whole = crc.combine(self.whole, value, last - at)
                found[i] = crc.combine(found[i], value, last - at)
                if last == ranges[i][0] + ranges[i][1]:
                    i += 1
            else:  # between ranges: the stretch's CRC only
                last = min(stop, ranges[i][0]) if i < len(ranges) else stop
                self.whole = crc.crc32(view[at - offset: last - offset], self.whole)
            at = last
        self._i, self.position = i, stop

    @property
    def complete(self) -> bool:
        return self.position == self.end


class RegionCrcs:
    """The CRC-32 of each region (offset, length, key) of one file, fed the chunks that are read of it
    (`inspect(offset, chunk)`, as `formats.nonfinite.Census` is: chunks of different regions in any
    order, each region's own bytes in order; a part read again is not fed twice, parts outside the
    regions are ignored). `found()`: {key: (CRC-32, length)} of the regions fed whole; a region not fed
    whole is a writer's bug (ValueError)."""

    def __init__(self, regions) -> None:
        self.regions = sorted(regions, key=lambda r: r[0])
        self._starts = [at for at, _n, _key in self.regions]
        self._crcs = [0] * len(self.regions)
        self._fed = [0] * len(self.regions)  # bytes of each region fed so far

    def inspect(self, offset: int, chunk) -> None:
        end = offset + len(chunk)
        i = max(0, bisect.bisect_right(self._starts, offset) - 1)
        while i < len(self.regions) and self.regions[i][0] < end:
            at, n, _key = self.regions[i]
            a, b = max(at + self._fed[i], offset), min(at + n, end)
            if b > a:
                if a != at + self._fed[i]:
                    raise ValueError(f"region {at}+{n}: bytes from {a} fed before those from {at + self._fed[i]}")
                self._crcs[i] = crc.crc32(chunk[a - offset: b - offset], self._crcs[i])
                self._fed[i] += b - a
            i += 1

    def found(self) -> dict:
        for (at, n, _key), fed in zip(self.regions, self._fed):
            if fed != n:
                raise ValueError(f"region {at}+{n}: {fed} of its bytes were read")
        return {key: (value, n) for (_at, n, key), value in zip(self.regions, self._crcs)}
