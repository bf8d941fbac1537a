"""The one reader of a rank's files: where a row's fp32 / exp_avg / exp_avg_sq bytes lie, checked.

A rank of a full save keeps, per sub-group, one flat tensor per key (`ds_format.TENSORS`) in
its optim_states file (a zip archive, or torch's legacy format): parameter p's slice on the
rank lies at its slot's offset in its sub-group's tensor. A rank of a partial save
(`selective`) keeps each saved parameter's slice as its own fp32 tensor `{key}/{param}` of its
rows file (safetensors), with a CRC-32 of its valid bytes recorded (`partial_rows`). Frozen
parameters' fragments and buffers lie in model_states. Every job that reads rank files —
merge, reshard, export, health statistics — asks a `RankReader` where bytes lie (`place`,
`fragments`, `buffer`) and reads them checked through `checked.evidence` (whole records
against their stored CRC-32, `read_and_check`; a partial's slice against its recorded one,
`SliceCheck`): a change of DeepSpeed's format or of a partial save's is made here alone.

Each kind of rank files is an adapter, a `RankReader`: `ZeroRankReader` (a full save: also its flat
tensors, `flat`) and `PartialRankReader` (a partial save: its rows file, `rows`); `rank_reader(files,
...)` gives a rank's. Another kind of checkpoint (PyTorch DCP's `.distcp` files) is one more.

Torch-free; each file's structure is read once, when first asked for.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, ClassVar

from tailor_tui.checked.evidence import SliceCheck
from tailor_tui.checkpoints.partial_rows import partial_slice, read_rows_file
from tailor_tui.errors import CheckpointError, IncompatibleError
from tailor_tui.formats.ds_format import MODULE, TENSORS, flat_tensor, optimizer_state
from tailor_tui.formats.pickled import dtype_name
from tailor_tui.formats.ptfile import (
    Record,
    Structure,
    TensorBytes,
    Unsupported,
    frozen_fragment_bytes,
    locate,
    read_structure,
    structure_in,
)

if TYPE_CHECKING:
    from tailor_tui.checkpoints.checkpoint import RankFiles

# The read buffer every streaming reader reuses: on this kind of VM fresh 64 MiB buffers ran at
# 0.6 GiB/s (page faults on every chunk); a reused 1 MiB buffer stays in CPU cache between read and CRC.
STREAM_CHUNK = 1 << 20

# A full save's optim file this small (a wide run's: tens of KiB) is read whole, once, by a job that
# reads its structure (`ptfile.read_whole`, `ZeroRankReader(optim=...)`): one read instead of several opens
SMALL_RANK_FILE = 1 << 20

FP32 = ("FloatStorage", 4)  # a partial save's slices, and the flat tensors health statistics read


@dataclass(frozen=True)
class RankBytes:
    """Where some elements of a rank's files lie: from byte `at` of `path`, in `record` (a full
    save's archive record, whose stored CRC-32 covers it) or in a partial's slice (`slice`)."""

    path: Path
    at: int
    record: Record | None
    dtype: str  # the storage type or dtype stored: FloatStorage, BFloat16Storage, torch.float32, …
    itemsize: int
    slice: SliceCheck | None = None


class RankReader(ABC):
    """One checkpoint's files of one rank, its sub-groups `group_sizes`: the adapter every kind of rank files
    implements (`rank_reader` gives the one for a rank's files). What is common, the model_states file
    (frozen parameters' fragments, buffers), is here; where a parameter's slice of a key lies, and what
    evidence checks it (`place`, `starts`), each kind says: a full ZeRO-3 save in its optim file's flat
    sub-group tensors (`ZeroRankReader`), a partial save in its rows file's per-parameter tensors
    (`PartialRankReader`). Each file's structure is read once, when first needed."""

    partial: ClassVar[bool]  # whether the kind keeps some rows only (a partial save)

    def __init__(self, files: RankFiles, group_sizes: tuple[int, ...]):
        self.files, self.group_sizes = files, tuple(group_sizes)
        self._fragments: dict[str, TensorBytes] = {}
        self._model: Structure | None = None

    @property
    def path(self) -> Path:
        """The file a row's optimizer bytes are read from (`RankFiles.state_file`)."""
        return self.files.state_file

    # -- where a parameter's slice lies: each kind's ------------------------------------------------

    @abstractmethod
    def place(self, key: str, *, param: str | None, group: int | None, offset: int, valid: int, within: int = 0,
              count: int = 0) -> RankBytes:
        """Where element `within` on of parameter `param`'s slice on this rank lies, for `key` (one of
        TENSORS), and the evidence it is checked against; the slice lies from element `offset` of sub-group
        `group`'s flat tensor (a full save) and holds `valid` elements, `count` of them taken from `within`."""

    def starts(self, key: str, slots) -> list[int]:
        """`place(key, ...).at` (where the slice starts) of each of `slots` (each with a param, group,
        offset and valid)."""
        return [self.place(key, param=s.param, group=s.group, offset=s.offset, valid=s.valid).at for s in slots]

    # -- model_states ----------------------------------------------------------------------------

    def model_structure(self) -> Structure:
        """(pickled object, {name: Record}, prefix) of model_states, read once."""
        if self._model is None:
            self._model = read_structure(self.files.model_states)
        return self._model

    def fragments(self, names) -> dict[str, TensorBytes]:
        """{name: TensorBytes} of frozen parameters' fragments in model_states."""
        missing = [name for name in names if name not in self._fragments]
        if missing:
            self._fragments.update(frozen_fragment_bytes(self.files.model_states, missing, self.model_structure()))
        return {name: self._fragments[name] for name in names}

    def buffer(self, name: str) -> TensorBytes:
        """Where persistent buffer `name` of the module lies in model_states."""
        obj, records, prefix = self.model_structure()
        try:
            return locate(obj[MODULE][name], records, prefix)
        except (KeyError, TypeError, Unsupported):
            raise CheckpointError(f"{self.files.model_states}: has no readable buffer {name}; the file is damaged "
                                  "or from another model") from None


class ZeroRankReader(RankReader):
    """A full ZeRO-3 save's rank: per sub-group, one flat tensor per key in its optim file (a zip archive,
    or torch's legacy format), each parameter's slice at its slot's offset; checked against the stored
    CRC-32 of the record holding it (`checked.evidence`). `optim`: the optim file's bytes, where the caller
    read it whole (`ptfile.read_whole`)."""

    partial = False

    def __init__(self, files: RankFiles, group_sizes: tuple[int, ...], optim: bytes | None = None):
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

    def records(self) -> dict[str, Record]:
        return self.structure()[1]

    def flat(self) -> dict[tuple[int, str], TensorBytes]:
        """{(sub-group, key): TensorBytes} of the optim file's flat fp32 weights and moments."""
        if self._flat is None:
            self._flat = flat_tensor_bytes(*self.structure(), self.files.optim_states, self.group_sizes)
        return self._flat

    def fp32_flat(self, purpose: str) -> dict[tuple[int, str], TensorBytes]:
        """`flat`, refused (CheckpointError naming `purpose`) unless every tensor holds fp32 values."""
        found = self.flat()
        for (g, key), tb in found.items():
            dtype = dtype_name(tb.dtype) if tb.dtype != "UntypedStorage" else "float32"
            if dtype != "float32" or tb.itemsize != 4:
                raise CheckpointError(f"{self.files.optim_states}: its {key} of sub-group {g} is {dtype}; "
                                      f"{purpose} read fp32 optimizer states")
        return found

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


class PartialRankReader(RankReader):
    """A partial save's rank (`selective`): each saved parameter's slice as its own fp32 tensor `{key}/{param}`
    of its rows file (safetensors), checked against the CRC-32 of its valid bytes the save recorded
    (`partial_rows`, `checked.evidence.SliceCheck`)."""

    partial = True

    def __init__(self, files: RankFiles, group_sizes: tuple[int, ...]):
        assert files.rows is not None, "a partial save's rank has a rows file"
        super().__init__(files, group_sizes)
        self.rows_file: Path = files.rows
        self._rows: tuple[dict, dict[str, int]] | None = None

    def rows(self) -> tuple[dict, dict[str, int]]:
        """(where each tensor of the rows file lies, {tensor: its recorded CRC-32})."""
        if self._rows is None:
            self._rows = read_rows_file(self.rows_file)
        return self._rows

    def place(self, key: str, *, param: str | None, group: int | None, offset: int, valid: int, within: int = 0,
              count: int = 0) -> RankBytes:
        """Checked to hold the slice's `valid` fp32 elements (its recorded CRC-32 covers those) and the
        `count` taken from `within`."""
        assert param is not None, "a partial save's slices are found by parameter"
        tensors, crcs = self.rows()
        begin = partial_slice(self.rows_file, tensors, key, param, max(valid, within + count))[2]
        name = f"{key}/{param}"
        return RankBytes(self.rows_file, begin + within * 4, None, FP32[0], FP32[1],
                         SliceCheck(self.rows_file, name, begin, valid * 4, crcs.get(name)))


def rank_reader(files: RankFiles, group_sizes: tuple[int, ...], optim: bytes | None = None) -> RankReader:
    """The reader of a rank's files, of their kind: a partial save's (`PartialRankReader`) or a full ZeRO-3
    save's (`ZeroRankReader`; `optim`: its optim file's bytes, where the caller read it whole)."""
    if files.rows is not None:
        return PartialRankReader(files, group_sizes)
    return ZeroRankReader(files, group_sizes, optim)


def flat_tensor_bytes(obj, records: dict[str, Record], prefix: str, path: Path,
                      group_sizes: tuple[int, ...]) -> dict[tuple[int, str], TensorBytes]:
    """{(sub-group, key): TensorBytes} of the flat tensors of an optim file read by `read_structure`."""
    inner = optimizer_state(obj, path, group_sizes)
    return {(g, key): locate(flat_tensor(inner, g, key), records, prefix)
            for g in range(len(group_sizes)) for key in TENSORS}


def tensor_bytes(path: Path, group_sizes: tuple[int, ...]) -> dict[tuple[int, str], TensorBytes]:
    """`flat_tensor_bytes` of the optim file `path`."""
    return flat_tensor_bytes(*read_structure(path, shared=True), path, group_sizes)


def check_dtypes(base: dict, theirs: dict, path: Path) -> None:
    """Refuse a source whose flat tensors are stored in another dtype than the base's (bf16
    optimizer states, say): their bytes would be reinterpreted. `base` maps (group, key) to
    TensorBytes or to (dtype, itemsize)."""
    for (g, key), tb in theirs.items():
        mine = base[g, key]
        expected = (mine.dtype, mine.itemsize) if isinstance(mine, TensorBytes) else mine
        if (tb.dtype, tb.itemsize) != expected:
            raise dtype_mismatch(path, key, g, tb.dtype, expected[0])


def dtype_mismatch(path: Path, key: str, group: int, theirs: str, mine: str) -> IncompatibleError:
    """`theirs`, `mine`: a torch dtype (`torch.bfloat16`) or storage type (`BFloat16Storage`)."""
    return IncompatibleError(
        f"{path}: its {key} of sub-group {group} is stored as {dtype_name(theirs)}, the base's as "
        f"{dtype_name(mine)}; checkpoints saved with another optimizer-state precision cannot be combined")
