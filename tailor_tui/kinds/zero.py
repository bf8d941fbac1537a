"""A full ZeRO-3 save's rank: per sub-group, one flat tensor per key (`ds_format.flat_keys`) in its optim_states
file (a zip archive, or torch's legacy format), parameter p's slice on the rank at its slot's offset in its
sub-group's tensor; each checked against the stored CRC-32 of the record holding it (`checked.evidence`).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import ClassVar, Mapping

from tailor_tui.formats.ds_format import MASTERS, flat_keys, flat_tensor, optimizer_state
from tailor_tui.formats.ptfile import Record, Structure, TensorBytes, locate, read_structure, read_whole, structure_in
from tailor_tui.kinds.base import RankBytes, RankFiles, RankReader, SaveKind


@dataclass(frozen=True)
class FullSave(SaveKind):
    """A full save: every row, its 16-bit weights in its model files (an HF checkpoint's), `latest` beside its
    tag."""

    kind: ClassVar[str] = "full"
    sliced: ClassVar[bool] = False
    masters_only: ClassVar[bool] = False
    keeps_latest: ClassVar[bool] = True
    own_files: ClassVar[frozenset[str]] = frozenset()

    def holds(self, row: str) -> bool:
        return True


FULL_SAVE = FullSave()


@dataclass(frozen=True)
class ZeroRankFiles(RankFiles):
    """A full ZeRO-3 save's rank."""

    kind: ClassVar[str] = "full"
    whole_records: ClassVar[bool] = True

    @property
    def state_file(self) -> Path:
        return self.optim_states

    @property
    def structure_file(self) -> Path:
        return self.optim_states

    def existing(self) -> tuple[Path, ...]:
        return (self.model_states, self.optim_states)

    def reader(self, group_sizes: tuple[int, ...], optim: bytes | None = None, *, small: bool = False) -> RankReader:
        if optim is None and small:
            optim = read_whole(self.optim_states)
        return ZeroRankReader(self, group_sizes, optim)


class ZeroRankReader(RankReader):
    """A full ZeRO-3 save's rank: per sub-group, one flat tensor per key in its optim file (a zip archive,
    or torch's legacy format), each parameter's slice at its slot's offset; checked against the stored
    CRC-32 of the record holding it (`checked.evidence`). `optim`: the optim file's bytes, where the caller
    read it whole (`ptfile.read_whole`)."""

    def __init__(self, files: ZeroRankFiles, group_sizes: tuple[int, ...], optim: bytes | None = None):
        super().__init__(files, group_sizes)
        self.optim = optim
        self._structure: Structure | None = None
        self._flat: dict[tuple[int, str], TensorBytes] | None = None

    def structure(self) -> Structure:
        """(pickled object, {name: Record}, prefix) of the optim file (`ptfile.read_structure`)."""
        if self._structure is None:
            self._structure = (read_structure(self.files.optim_states, shared=True) if self.optim is None
                               else structure_in(self.files.optim_states, self.optim))
        return self._structure

    def archive(self) -> Mapping[str, Record]:
        return self.structure()[1]

    def flat(self) -> dict[tuple[int, str], TensorBytes]:
        """{(sub-group, key): TensorBytes} of the optim file's flat fp32 weights and per-element optimizer state."""
        if self._flat is None:
            self._flat = flat_tensor_bytes(*self.structure(), self.files.optim_states, self.group_sizes)
        return self._flat

    def whole_flat(self) -> dict[tuple[int, str], TensorBytes]:
        return self.flat()

    def keys(self) -> tuple[str, ...]:
        return (MASTERS, *dict.fromkeys(key for (_g, key) in self.flat() if key != MASTERS))

    def place(self, key: str, *, param: str | None, group: int | None, offset: int, valid: int, within: int = 0,
              count: int = 0) -> RankBytes:
        assert group is not None, "a full save's slices are found by sub-group"
        tb = self.flat()[group, key]
        return RankBytes(self.files.optim_states, tb.offset + (offset + within) * tb.itemsize, tb.record, tb.dtype,
                         tb.itemsize)

    def starts(self, key: str, slots) -> list[int]:
        """Without a RankBytes each: a wide run's rank file is asked for thousands."""
        flat = self.flat()
        return [flat[s.group, key].offset + s.offset * flat[s.group, key].itemsize for s in slots]


def flat_tensor_bytes(obj, records: Mapping[str, Record], prefix: str, path: Path,
                      group_sizes: tuple[int, ...]) -> dict[tuple[int, str], TensorBytes]:
    """{(sub-group, key): TensorBytes} of the flat tensors of an optim file read by `read_structure`."""
    inner = optimizer_state(obj, path, group_sizes)
    keys = flat_keys(inner, path, group_sizes)
    return {(g, key): locate(flat_tensor(inner, g, key), records, prefix)
            for g in range(len(group_sizes)) for key in keys}


def tensor_bytes(path: Path, group_sizes: tuple[int, ...]) -> dict[tuple[int, str], TensorBytes]:
    """`flat_tensor_bytes` of the optim file `path`."""
    return flat_tensor_bytes(*read_structure(path, shared=True), path, group_sizes)


