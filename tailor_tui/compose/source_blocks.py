"""A cloned composition's sources read only where the output takes their bytes, each block read
checked against the CRC-32 the run's statistics recorded of it.

A record's CRC-32 covers all of it: checking the few rows a recipe takes from a source against it
means reading the whole record (a rank file's flat tensors are a few large records: a 1-row recipe
would read the source's rank files whole). The health statistics read every record of a full
checkpoint's optim file whole anyway, checked its CRC-32, and recorded the CRC-32 of each 1 MiB
block of it (`crc.BlockCrcs`, cached by `checkpoints.file_facts` under each file's identity). Where the
output is a clone, planning looked each source's rank files up by their identity (`planning.reads`: a
stat per file, no rank file read) and gave each rank's job the blocks of its sources
(`RankJob.source_blocks`); the ranges the output takes from a record with recorded blocks are read as
those blocks only, each block once and checked (`read_taken`, `checked.evidence.read_blocks`); a block
whose bytes fail its recorded CRC-32 fails the task as a failed record CRC-32 does (the file changed
since its statistics without its identity changing: bit rot). The recorded values are evidence of what the bytes should
be; each block read proves what they are. A record without recorded blocks, or laid out otherwise
than when they were recorded, or whose recorded values do not combine to the CRC-32 it declares (a
damaged cache entry), is read whole and checked, as always. The base is always read whole (the
clone keeps only bytes it checked: `rank_stream`).
"""

from __future__ import annotations

from collections import defaultdict
from pathlib import Path

from tailor_tui.checked.crc import RecordBlocks
from tailor_tui.checked.evidence import Counts, blocks_usable, read_and_check, read_blocks
from tailor_tui.events import ByteCounter
from tailor_tui.formats.ptfile import Record
from tailor_tui.planning.jobs import RankJob


def of_source(job: RankJob, source: int) -> dict[str, RecordBlocks]:
    """The blocks `job` carries of `source`'s optim file, by record name."""
    return {b.name: b for s, b in job.source_blocks if s == source}


def read_taken(fd: int, path: Path, taken: set[tuple[Record | None, int, int]], blocks: dict[str, RecordBlocks], *,
               buffer: memoryview, counter: ByteCounter, census: Counts) -> dict[tuple[int, int], int]:
    """The CRC-32 of each range `taken` (record, offset, length) of a source's file `fd`, as
    `read_and_check` returns them, every byte taken checked: the ranges of a record whose `blocks` (by
    name) still describe it are read as the blocks that cover them, each checked against its recorded
    CRC-32 (the rest of the record not read: counted as `counter.skips`); the other records are read
    whole and checked against their own CRC-32s. `census` counts the non-finite values of what is read."""
    ranges: defaultdict[Record, list[tuple[int, int]]] = defaultdict(list)
    for record, at, n in taken:
        assert record is not None, "a full source's ranges lie in its records"
        ranges[record].append((at, n))
    by_blocks = {r for r, mine in ranges.items() if blocks_usable(r, blocks.get(r.name), mine)}
    found = read_and_check(fd, path, ranges.keys() - by_blocks, {t for t in taken if t[0] not in by_blocks},
                           buffer, counter=counter, census=census)
    for record in sorted(by_blocks, key=lambda r: r.data_offset):
        found.update(read_blocks(fd, path, record, blocks[record.name], sorted(ranges[record]), buffer=buffer,
                                 counter=counter, census=census))
    return found
