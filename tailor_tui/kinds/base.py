"""What every kind of checkpoint's rank files is asked, and the helpers the kinds share.

A rank's files (`RankFiles`) say which files hold what: its model_states, the file of its optimizer
state's tensors (`state_file`) and of the structure around them (`structure_file`), whether those tensors
are whole records checked whole against the CRC-32 their archive stores (`whole_records`; else slices,
each checked against a CRC-32 recorded apiece), and its reader (`reader`). The reader (`RankReader`) says
where a parameter's slice of a key lies and the evidence it is checked against (`place`, `starts`), and
where frozen parameters' fragments and buffers lie in model_states (the same for every kind here).

What a checkpoint of a kind saved as a whole (`SaveKind`) says which rows it holds, where its 16-bit
weights come from, and which of its folder's files are tailor-tui's own; its weights, for an output's weight
files (`WeightSource`), where each tensor lies (`WeightPiece`s).

Each kind is a module of this package, what it saved, its files and its reader: `zero` (a full ZeRO-3 save) and
`partial` (a partial save of `selective`). Planning, the writers, the statistics and the exporter ask
these, never telling the kinds apart themselves; another kind (PyTorch DCP's `.distcp` shards) is one
more module. Torch-free; each file's structure is read once, when first asked for.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from pathlib import Path
from typing import ClassVar, Mapping

from tailor_tui.checked.evidence import SliceCheck
from tailor_tui.errors import CheckpointError, IncompatibleError
from tailor_tui.formats.ds_format import MODULE
from tailor_tui.formats.pickled import dtype_name
from tailor_tui.formats.ptfile import (
    Record,
    Structure,
    TensorBytes,
    Unsupported,
    frozen_fragment_bytes,
    locate,
    read_structure,
)

FP32 = ("FloatStorage", 4)  # a partial save's slices, and the flat tensors health statistics read


class SaveKind(ABC):
    """What a checkpoint of one kind saved as a whole, beside each rank's files (`RankFiles`): the questions
    planning, the writers, the statistics and the verifier ask of a checkpoint's kind, never telling kinds
    apart themselves. A full save (`zero.FullSave`) holds every row, its 16-bit weights in model files of its
    own; a partial save (`partial.PartialSave`) some rows, its weights cast from their fp32 masters."""

    kind: ClassVar[str]  # for messages: "full", "partial"
    # its rows' optimizer state lies in slices kept apart per parameter: an output taking a row from it lists
    # each slice, and one on it as base has no optim file to start from (written whole)
    sliced: ClassVar[bool]
    # its 16-bit weights are cast from its fp32 masters: it has no model files (nor a PEFT adapter, nor `.bin`
    # files) of its own; planning refuses it where a weight file it lacks needs a row picked from it
    masters_only: ClassVar[bool]
    # its folder keeps a `latest` naming its tag (a DeepSpeed tag base's lies outside what is composed)
    keeps_latest: ClassVar[bool]
    own_files: ClassVar[frozenset[str]]  # tailor-tui's records in its folder, never copied into an output

    @abstractmethod
    def holds(self, row: str) -> bool:
        """Whether it saved row `row` (by its name; a tied row, with no weights of its own, is the caller's)."""

    @property
    def model_layout(self) -> Path | None:
        """The file recording the layout (names, headers, index) its model files had, where it has none."""
        return None

    def summary(self, rows: int) -> str | None:
        """What sets it apart in a checkpoint's description (of `rows` rows with weights), or None."""
        return None


@dataclass(frozen=True)
class RankFiles(ABC):
    """One rank's files of a checkpoint (its model_states, and where its optimizer state lies)."""

    rank: int
    model_states: Path
    optim_states: Path  # the optim file's name (in a partial save: the name a full one would have, absent)

    kind: ClassVar[str]  # for messages: "full", "partial"
    # its optimizer state's tensors lie in whole records, each checked whole against the CRC-32 it stores
    # (the run's statistics record their blocks' CRC-32s too); else in slices, each checked apiece
    whole_records: ClassVar[bool]

    @property
    @abstractmethod
    def state_file(self) -> Path:
        """The file holding the rank's optimizer state's tensors (fp32 masters, the per-element state)."""

    @property
    @abstractmethod
    def structure_file(self) -> Path:
        """The file holding the rest of the optimizer state (param groups, loss scaler, steps, counters): a
        torch file DeepSpeed's loader reads, with or without the big tensors."""

    @abstractmethod
    def existing(self) -> tuple[Path, ...]:
        """Every file of the rank, as the checkpoint holds them."""

    @abstractmethod
    def reader(self, group_sizes: tuple[int, ...], optim: bytes | None = None, *, small: bool = False) -> RankReader:
        """The reader of these files (its sub-groups `group_sizes`; `optim`: a full save's optim file's bytes,
        where the caller read it whole; `small`: read it whole here where it is small)."""

    def cuts(self, param: str) -> tuple[int, ...]:
        """Where a piece of parameter `param` taken from this rank must be cut (its elements from the first of the
        part on this rank): none where its part lies in one place (a ZeRO-3 save's); a DCP checkpoint's chunks'
        edges (`dcp_rows`)."""
        return ()

    def elements_checked(self, groups, taken: int, group_sizes) -> int:
        """The elements read to check `taken` elements of sub-groups `groups` (ids into `group_sizes`) taken
        from this rank's state, per key: whole sub-group records (their stored CRC-32 covers the whole
        record), or the slices alone (recorded CRC-32s cover each slice)."""
        return sum(group_sizes[g] for g in set(groups)) if self.whole_records else taken


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
    implements (`RankFiles.reader`, `rank_reader`, gives the one for a rank's files). What is common, the model_states file
    (frozen parameters' fragments, buffers), is here; where a parameter's slice of a key lies, and what
    evidence checks it (`place`, `starts`), each kind says: a full ZeRO-3 save in its optim file's flat
    sub-group tensors (`ZeroRankReader`), a partial save in its rows file's per-parameter tensors
    (`PartialRankReader`). Each file's structure is read once, when first needed."""

    def __init__(self, files: RankFiles, group_sizes: tuple[int, ...]):
        self.files, self.group_sizes = files, tuple(group_sizes)
        self._fragments: dict[str, TensorBytes] = {}
        self._model: Structure | None = None

    @property
    def path(self) -> Path:
        """The file a row's optimizer bytes are read from (`RankFiles.state_file`)."""
        return self.files.state_file

    def paths(self) -> tuple[Path, ...]:
        """Every file `place` may place bytes in: `path`; a DCP checkpoint's every `.distcp` file."""
        return (self.path,)

    # -- where a parameter's slice lies: each kind's ------------------------------------------------

    @abstractmethod
    def place(self, key: str, *, param: str | None, group: int | None, offset: int, valid: int, within: int = 0,
              count: int = 0) -> RankBytes:
        """Where element `within` on of parameter `param`'s slice on this rank lies, for `key` (one of
        `keys()`), and the evidence it is checked against; the slice lies from element `offset` of sub-group
        `group`'s flat tensor (a full save) and holds `valid` elements, `count` of them taken from `within`."""

    @abstractmethod
    def keys(self) -> tuple[str, ...]:
        """The flat tensors a row's slices lie in on this rank: the fp32 masters (`ds_format.MASTERS`) first, then
        the optimizer's state kept per element, sorted (`ds_format.state_keys`: Adam's exp_avg and exp_avg_sq,
        SGD's momentum_buffer, …). Refused (a TailorError naming the file): a state that cannot be taken apart by
        row. Asked at planning, before anything is read for the output."""

    def whole_flat(self) -> dict[tuple[int, str], TensorBytes] | None:
        """{(sub-group, key): TensorBytes} of the flat tensors, where this kind stores each whole in a record whose
        stored CRC-32 covers it (a full save's: read whole to check what is taken of it); None where its state lies
        in slices kept apart, each checked apiece as it is read (a partial save's)."""
        return None

    def fp32_whole_flat(self, purpose: str) -> dict[tuple[int, str], TensorBytes] | None:
        """`whole_flat`, refused (CheckpointError naming `purpose`) unless every tensor holds fp32 values."""
        found = self.whole_flat()
        for (g, key), tb in (found or {}).items():
            dtype = dtype_name(tb.dtype) if tb.dtype != "UntypedStorage" else "float32"
            if dtype != "float32" or tb.itemsize != 4:
                raise CheckpointError(f"{self.path}: its {key} of sub-group {g} is {dtype}; {purpose} read fp32 "
                                      "optimizer states")
        return found

    def archive(self) -> Mapping[str, Record] | None:
        """{name: Record} of every record of the archive `whole_flat`'s tensors lie in, where this kind keeps them
        in one (a full save's optim file, everything in it); None where it keeps none."""
        return None

    def check_keys(self, planned: tuple[str, ...]) -> None:
        """Refuse a rank whose flat tensors are not the ones the plan found (`check_keys`)."""
        check_keys(self.path, self.keys(), planned)

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


@dataclass(frozen=True)
class WeightPiece:
    """Where part of an output weight file's tensor lies in a source's files: `count` elements stored as
    `stored` (a safetensors dtype: "BF16", "F32", …) from byte `at` of `path`, for the tensor's elements from
    `into` on; checked against `check` (a partial save's recorded slice CRC-32), or by nothing stored (a
    safetensors file keeps no checksum: what is taken is recorded, `compose.taken`)."""

    path: Path
    at: int
    count: int
    stored: str
    into: int = 0
    check: SliceCheck | None = None


class WeightSource(ABC):
    """One source's weights for an output's safetensors weight files (16-bit model files or shards, a PEFT
    adapter): the adapter every kind implements, saying where each tensor lies. A full HF save keeps them in
    files of its own (`hf_weights.FileWeights`: each tensor whole, by name, copied as it is); a partial save has none
    and gives its fp32 masters' slices (`partial.MasterWeights`: cast to the file's dtype). Picklable: a job
    carries it to its worker."""

    name: str  # the checkpoint's, for messages
    # it may give tensors that are no byte range of its files (frozen parameters, buffers: in its ranks'
    # model_states, read by torch): the worker writing from it loads torch
    loads_states: ClassVar[bool] = False

    @property
    @abstractmethod
    def files(self) -> tuple[Path, ...]:
        """Every file it may read (their identities are checked where they are read)."""

    @abstractmethod
    def pieces(self, tensor: str, param: str, dtype: str, shape: tuple[int, ...]) -> tuple[WeightPiece, ...] | None:
        """Where the output's tensor `tensor` (of parameter or buffer `param`), `dtype` and `shape` in the output's
        file, lies, in order, side by side; None where it is no byte range of its files (`loads_states`). KeyError:
        it has no such tensor; CheckpointError: it has one of another dtype or shape."""


def rank_reader(files: RankFiles, group_sizes: tuple[int, ...], optim: bytes | None = None, *,
                small: bool = False) -> RankReader:
    """The reader of a rank's files, of their kind (`RankFiles.reader`)."""
    return files.reader(group_sizes, optim, small=small)


def check_keys(path: Path, mine: tuple[str, ...], planned: tuple[str, ...]) -> None:
    """Refuse (CheckpointError naming `path`) a rank file whose flat tensors (`mine`: the masters and the state kept
    per element) are not the ones the plan found on its checkpoint's first rank (`planned`, `RankReader.keys`):
    the checkpoint's ranks disagree on what the optimizer keeps."""
    if mine != planned:
        raise CheckpointError(f"{path}: keeps {', '.join(mine)} per sub-group, the checkpoint's first rank "
                              f"{', '.join(planned)}; its ranks disagree: the checkpoint is corrupt or mixed from "
                              "other runs, re-copy it")


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
