"""What the composition took, as its provenance record says (`checkpoint.TAKEN`), against what the output
holds: the verifier's own reading of that record and its own CRC-32s of the output's rows.

The record holds, per output rank, row and tensor (fp32, exp_avg, exp_avg_sq; "frozen": the row's frozen
parameters' fragments), the CRC-32 of the row's real elements on that rank, its parameters in the output's
order (sub-group, then offset; frozen ones in the layout's order), padding left out: what the writers read
and checked in the sources. The verifier works the same CRC-32s out of the output's bytes (`RowCrcs`, zlib's
CRC over the elements in that order, none of the writers' code) and settles each row (`settle`): rows of a
source that changed since the composition (its files' identities, or a file that fails its CRC-32s now
though the composition read and checked it: bit rot) are proven against the record alone; the others are
compared with their sources byte for byte and must match the record too. The record is what the writers
took: it proves the output is what was composed, never that the writers took the right bytes (a row that
differs from its unchanged source is a bad output whatever the record says).
"""

from __future__ import annotations

import struct
import zipfile
import zlib
from dataclasses import dataclass, field
from pathlib import Path

from tailor_tui.checked import crc
from tailor_tui.checkpoints.checkpoint import TAKEN_FROZEN
from tailor_tui.verifying.torch_files import open_binary

FROZEN = TAKEN_FROZEN  # a row's frozen fragments, in the record
MAX_CRC = 0xFFFFFFFF


def recorded(record: object, taken_key: str) -> dict[str, dict[str, dict[str, int]]] | None:
    """{rank: {row: {tensor: CRC-32}}} of a provenance record (None: it has none, an older output's, or
    one not well formed: nothing is taken from it then). `record` comes from a file: every field is checked."""
    if not isinstance(record, dict):
        return None
    taken = record.get(taken_key)
    if not isinstance(taken, dict):
        return None
    for rank, rows in taken.items():
        if not (isinstance(rank, str) and rank.isascii() and rank.isdigit() and isinstance(rows, dict)):
            return None
        if not all(isinstance(row, str) and _crcs(crcs) for row, crcs in rows.items()):
            return None
    return taken


def recorded_weights(record: object, key: str) -> dict[str, dict[str, int]] | None:
    """{model file: {tensor: CRC-32}} of a provenance record (None: it has none, or not well formed)."""
    found = record.get(key) if isinstance(record, dict) else None
    if not isinstance(found, dict):
        return None
    if not all(isinstance(name, str) and _crcs(crcs) for name, crcs in found.items()):
        return None
    return found


def recorded_crcs(record: object, key: str) -> dict[str, int] | None:
    """{path in the output: CRC-32} a provenance record keeps under `key` (the files copied from the base,
    the archives' listings, the weight files' headers); None: it has none, or not well formed."""
    found = record.get(key) if isinstance(record, dict) else None
    return found if _crcs(found) else None


class Archives:
    """The output's rank files' (and torch-format weight files') records as the composition wrote them
    (`checkpoint.ARCHIVES`: per file, the CRC-32 of its records' listing), compared with the output's own
    directories (zipfile's reading), each file once. A file whose records match, each of them checked against
    its stored CRC-32 where it is read, holds what was composed: the state around the rows is proven so once
    the base changed."""

    def __init__(self, recorded: dict[str, int] | None, out: Path, tag: str):
        self.recorded, self.out, self.tag = recorded, out, tag
        self.found: dict[str, bool] = {}
        self.failed: list[str] = []  # a FAIL line for each file whose records are not those written

    def proven(self, names) -> bool:
        """Whether the output's rank files `names` (in its tag folder) hold the records the composition wrote;
        False where the record keeps none of one (an older output's)."""
        return all(self.file_proven(f"{self.tag}/{name}") for name in names)

    def recorded_for(self, rel: str) -> bool:
        """Whether the record keeps the listing of the output's file `rel` (relative to the output)."""
        return self.recorded is not None and rel in self.recorded

    def file_proven(self, rel: str) -> bool:
        """Whether the output's file `rel` (a rank file or a torch-format weight file, relative to the output)
        holds the records the composition wrote; a FAIL line (`failed`) where it is recorded and does not."""
        if self.recorded is None or rel not in self.recorded:
            return False
        if rel not in self.found:
            try:
                with open_binary(self.out / rel) as f, zipfile.ZipFile(f) as archive:
                    listing = b"".join(info.filename.encode() + b"\0" + struct.pack("<I", info.CRC)
                                       for info in archive.infolist())
                self.found[rel] = zlib.crc32(listing) == self.recorded[rel]
            except (OSError, zipfile.BadZipFile):
                self.found[rel] = False
            if not self.found[rel]:
                self.failed.append(f"{self.out / rel}: its records are not those the composition wrote (its "
                                   "provenance record)")
        return self.found[rel]


def _crcs(crcs: object) -> bool:
    """Whether a record's {tensor: CRC-32} is one: names, and whole numbers a CRC-32 can be."""
    return isinstance(crcs, dict) and all(isinstance(k, str) and type(v) is int and 0 <= v <= MAX_CRC
                                          for k, v in crcs.items())


class RowCrcs:
    """The CRC-32 of each (row, tensor) of one output rank, fed its parts in order (`add`)."""

    def __init__(self) -> None:
        self.found: dict[str, dict[str, int]] = {}

    def add(self, row: str, key: str, tensor) -> None:
        import torch

        data = tensor.detach().contiguous().reshape(-1).view(torch.uint8).numpy()
        if not len(data):
            return
        mine = self.found.setdefault(row, {})
        mine[key] = zlib.crc32(data, mine.get(key, 0))

    def add_crc(self, row: str, key: str, value: int, length: int) -> None:
        """The next part of (row, tensor): `length` bytes whose CRC-32 is `value`."""
        if not length:
            return
        mine = self.found.setdefault(row, {})
        mine[key] = crc.combine(mine.get(key, 0), value, length)


@dataclass
class RankRows:
    """What the checks of one output rank found, for `settle`."""

    crcs: RowCrcs = field(default_factory=RowCrcs)
    differing: dict[str, list[tuple[str, int]]] = field(default_factory=dict)  # row -> (problem, source)
    from_changed: dict[str, int] = field(default_factory=dict)  # row -> its changed source: not compared

    def differs(self, row: str, problem: str, source: int) -> None:
        found = self.differing.setdefault(row, [])
        if (problem, source) not in found:  # (a rank compared again once a source was found changed)
            found.append((problem, source))


def settle(report, rank: int, rows: RankRows, taken: dict | None, names: list[str]) -> None:
    """Report the problems each row of one output rank has, given what the provenance record says it took
    (`taken`; None: no record), and note each row proven by the record alone (`report.by_record`)."""
    mine = taken.get(str(rank)) if taken is not None else None
    for row in sorted(rows.crcs.found.keys() | rows.differing.keys() | rows.from_changed.keys()):
        matches = mine is not None and mine.get(row) == rows.crcs.found.get(row)
        if row in rows.from_changed:
            s = rows.from_changed[row]
            if mine is None:
                report.add(row, f"rank {rank}: not proven: {names[s]} changed since the composition, and the "
                                "output's provenance record holds no CRC-32s of what was taken")
            elif not matches:
                report.add(row, f"rank {rank}: differs from what the composition took from {names[s]} "
                                "(the CRC-32s its provenance record holds)")
            else:
                report.by_record.add(row)
        elif row in rows.differing:  # from a source as the composition read it (its identity, its CRC-32s):
            for problem, _s in rows.differing[row]:  # what the record says was taken does not excuse it
                report.add(row, problem)
        elif mine is not None and not matches:
            report.add(row, f"rank {rank}: equals its source but not the CRC-32s the composition recorded of "
                            "what it took (the provenance record is not this output's)")
