"""What a rank's task took into the output, as its provenance record keeps it (`checkpoint.TAKEN`): per
row and tensor, the CRC-32 of the row's real elements on that rank, its parameters in the output's order
(sub-group, then offset; frozen parameters in the layout's order), padding left out. The writers work
them out from the bytes they read and checked, in the same reads (`RegionCrcs`, or in memory); `--verify`
proves the output's rows against them, and so tells a source that changed since the composition from an
output that differs from what was composed (`verifying.against_recipe`). Each rank file's records, as
written, are kept too (`written`: the CRC-32 each record's directory entry stores), which proves the state
around the rows once the base changed.
"""

from __future__ import annotations

import os
import struct
from collections import Counter
from dataclasses import dataclass, field

from tailor_tui.checked import crc
from tailor_tui.checkpoints.checkpoint import TAKEN_FROZEN
from tailor_tui.fileio import Target, open_target, path_of
from tailor_tui.formats.zipdir import read_directory_of

FROZEN = TAKEN_FROZEN  # a row's frozen fragments, in the record

# a part of a row on one rank: (row, tensor, where: (sub-group, its first element in that flat tensor), or
# for a frozen fragment (the parameter's place in the layout's frozen ones, its first element)) -> (CRC-32, bytes)
Parts = dict[tuple[str, str, tuple[int, int]], tuple[int, int]]


@dataclass(frozen=True)
class RankComposed:
    """What composing one rank's files gives back: the NaN/Inf values each row's parts hold in the output,
    and what was taken (`taken`: {row: {tensor: CRC-32}})."""

    rank: int
    nonfinite: Counter = field(default_factory=Counter)
    taken: dict[str, dict[str, int]] = field(default_factory=dict)
    # the rank's files as written: {file name: the CRC-32 of its records' listing} (`written`)
    archives: dict[str, int] = field(default_factory=dict)


@dataclass(frozen=True)
class FileComposed:
    """What composing one weight file gives back, for `--verify` to prove it by once a source changed:
    `taken`, {tensor: CRC-32}, of a safetensors file every tensor's bytes as written (the base's kept ones
    too), of a torch-format one each storage taken from a source; `header`, the CRC-32 of a safetensors
    file's header (its 8-byte length and JSON); `archive`, the CRC-32 of a torch-format file's records'
    listing as written (`written`)."""

    name: str
    taken: dict[str, int] = field(default_factory=dict)
    header: int | None = None
    archive: int | None = None


def written(*files: Target) -> dict[str, int]:
    """{file name: the CRC-32 of its records' listing (`checkpoint.ARCHIVES`)} of the zip archives `files` as
    they were just written, their directories read back through the folder held open: what `--verify` proves
    a rank file's every record by once its sources changed."""
    found = {}
    for target in files:
        with os.fdopen(open_target(target, os.O_RDONLY), "rb") as f:
            listing = b"".join(entry.name.encode() + b"\0" + struct.pack("<I", entry.crc)
                               for entry in read_directory_of(f))
        found[path_of(target).name] = crc.crc32(listing)
    return found


def rows_taken(parts: Parts) -> dict[str, dict[str, int]]:
    """{row: {tensor: CRC-32}} of a rank's parts, each row's parts of a tensor combined in order."""
    found: dict[str, dict[str, int]] = {}
    for (row, key, _where), (value, n) in sorted(parts.items(), key=lambda kv: kv[0][2]):
        if not n:
            continue
        mine = found.setdefault(row, {})
        mine[key] = crc.combine(mine.get(key, 0), value, n)
    return found


class Looks:
    """What one file's chunks are fed to as they are read (`inspect`): a census of the non-finite values
    of the rows it gives (`counts`) and the CRC-32s of the parts it gives (`parts`, a `RegionCrcs` keyed
    as `Parts`)."""

    def __init__(self, census, parts) -> None:
        self.census, self.parts = census, parts

    def inspect(self, offset: int, chunk) -> None:
        self.census.inspect(offset, chunk)
        self.parts.inspect(offset, chunk)

    @property
    def counts(self) -> Counter:
        return self.census.counts
