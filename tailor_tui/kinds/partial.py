"""A partial save's rank (`selective`): each saved parameter's slice as its own fp32 tensor `{key}/{param}` of its
rows file (`tailor_rows_rank_{r}.safetensors`), the rest of its optimizer state in a skeleton file.

safetensors stores no checksum, so `selective.save_rows` records one per tensor in the file's
metadata: under "crc32", a JSON object {tensor name: CRC-32 of its first `valid` elements}
(the rank's real data; the padding after it is not covered, nor ever read). Readers check
each slice they take against it, so a flipped bit in a partial save is refused instead of
being carried into a composed file under a fresh CRC. Saves made before the CRCs were
recorded have none: their slices are taken unchecked.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import ClassVar

from tailor_tui.checked import crc
from tailor_tui.checked.evidence import SliceCheck
from tailor_tui.errors import CheckpointError
from tailor_tui.formats.ds_format import MASTERS, MAX_NAME, MAX_STATES, TENSORS
from tailor_tui.formats.safetensors_in import safetensors_header, tensor_places
from tailor_tui.kinds.base import FP32, RankBytes, RankFiles, RankReader, SaveKind, WeightPiece, WeightSource

# A partial save's folder: its manifest (the rows it saved, its tag, layout and dtype), per rank its rows
# file and its skeleton, and (HF layout) the 16-bit model files' headers and index it had
PARTIAL_MANIFEST = "tailor_partial.json"
PARTIAL_ROWS = "tailor_rows_rank_{rank}.safetensors"
PARTIAL_SKELETON = "tailor_optim_skeleton_rank_{rank}.pt"
PARTIAL_MODEL_FILES = "tailor_model_files.json"


@dataclass(frozen=True)
class PartialSave(SaveKind):
    """A partial save: the rows its manifest names (`rows`), their slices in its rows files, no model files (the
    layout they had recorded in `layout_file` where its save saw them), its tag named by its manifest."""

    rows: frozenset[str]
    layout_file: Path | None = None

    kind: ClassVar[str] = "partial"
    sliced: ClassVar[bool] = True
    masters_only: ClassVar[bool] = True
    keeps_latest: ClassVar[bool] = False
    own_files: ClassVar[frozenset[str]] = frozenset({PARTIAL_MANIFEST, PARTIAL_MODEL_FILES})

    def holds(self, row: str) -> bool:
        return row in self.rows

    @property
    def model_layout(self) -> Path | None:
        return self.layout_file

    def summary(self, rows: int) -> str | None:
        return f"partial saved {len(self.rows)} of {rows} rows"


@dataclass(frozen=True)
class PartialRankFiles(RankFiles):
    """A partial (selective) save's rank."""

    rows: Path  # the saved rows' slices of the fp32 masters and of each per-element state (safetensors)
    skeleton: Path  # the optimizer state without its big tensors

    kind: ClassVar[str] = "partial"
    whole_records: ClassVar[bool] = False

    @property
    def state_file(self) -> Path:
        return self.rows

    @property
    def structure_file(self) -> Path:
        return self.skeleton

    def existing(self) -> tuple[Path, ...]:
        return (self.model_states, self.rows, self.skeleton)

    def reader(self, group_sizes: tuple[int, ...], optim: bytes | None = None, *, small: bool = False) -> RankReader:
        return PartialRankReader(self, group_sizes)


class PartialRankReader(RankReader):
    """A partial save's rank (`selective`): each saved parameter's slice as its own fp32 tensor `{key}/{param}`
    of its rows file (safetensors), checked against the CRC-32 of its valid bytes the save recorded
    (`read_rows_file`, `checked.evidence.SliceCheck`)."""

    def __init__(self, files: PartialRankFiles, group_sizes: tuple[int, ...]):
        super().__init__(files, group_sizes)
        self.rows_file: Path = files.rows
        self._rows: tuple[dict, dict[str, int], tuple[str, ...]] | None = None

    def rows(self) -> tuple[dict, dict[str, int], tuple[str, ...]]:
        """(where each tensor of the rows file lies, {tensor: its recorded CRC-32}, the keys it holds slices of)."""
        if self._rows is None:
            self._rows = read_rows_file(self.rows_file)
        return self._rows

    def keys(self) -> tuple[str, ...]:
        """The keys its rows file holds slices of (`{key}/{param}`), the masters first: the per-element state the
        selective saver found (`ds_format.state_keys`, checked where it saved from), as it recorded them (a save
        made before it recorded them: Adam's, the one optimizer it saved then)."""
        return self.rows()[2]

    def place(self, key: str, *, param: str | None, group: int | None, offset: int, valid: int, within: int = 0,
              count: int = 0) -> RankBytes:
        """Checked to hold the slice's `valid` fp32 elements (its recorded CRC-32 covers those) and the
        `count` taken from `within`."""
        assert param is not None, "a partial save's slices are found by parameter"
        tensors, crcs, _keys = self.rows()
        begin = partial_slice(self.rows_file, tensors, key, param, max(valid, within + count))[2]
        name = f"{key}/{param}"
        return RankBytes(self.rows_file, begin + within * 4, None, FP32[0], FP32[1],
                         SliceCheck(self.rows_file, name, begin, valid * 4, crcs.get(name)))


@dataclass(frozen=True)
class MasterWeights(WeightSource):
    """A partial save as the source of an output's model-file tensors: it saves no 16-bit weights, so each
    trainable parameter is its fp32 master, every rank's slice (`parts`: parameter -> (elements per rank, the
    valid elements on each rank)) side by side, each checked against the CRC-32 its save recorded, cast to the
    file's dtype: exactly the 16-bit weight, which ZeRO-3 casts from the master after each step (round to
    nearest even). Frozen parameters and buffers have no master: they lie in its ranks' model_states."""

    name: str
    ranks: tuple[PartialRankFiles, ...]
    parts: dict[str, tuple[int, tuple[int, ...]]]
    _readers: dict = field(default_factory=dict, compare=False, repr=False)  # rows file -> its reader, read once

    loads_states: ClassVar[bool] = True

    @property
    def files(self) -> tuple[Path, ...]:
        return tuple(f for files in self.ranks for f in files.existing())

    def pieces(self, tensor: str, param: str, dtype: str, shape: tuple[int, ...]) -> tuple[WeightPiece, ...] | None:
        if param not in self.parts:
            return None
        part, valid = self.parts[param]
        found = []
        for rank, files in enumerate(self.ranks):
            if not valid[rank]:
                continue
            if files.rows not in self._readers:
                self._readers[files.rows] = PartialRankReader(files, ())
            place = self._readers[files.rows].place(MASTERS, param=param, group=None, offset=0, valid=valid[rank])
            found.append(WeightPiece(place.path, place.at, valid[rank], "F32", rank * part, place.slice))
        return tuple(found)


CRC_METADATA = "crc32"
KEYS_METADATA = "keys"  # the keys of the slices it holds, the masters first (a JSON list; before: Adam's)

def crc_metadata(slices: dict[str, memoryview]) -> str:
    """The metadata value recording each slice's CRC-32 (`slices`: name -> its valid bytes)."""
    return json.dumps({name: crc.crc32(view) for name, view in sorted(slices.items())}, separators=(",", ":"))


def read_rows_file(path: Path) -> tuple[dict, dict[str, int], tuple[str, ...]]:
    """From one read of the rows file `path`'s header: where each tensor lies (as
    `safetensors_in.safetensors_tensors`), {tensor name: CRC-32 of its valid bytes} recorded
    ({} if none), and the keys it holds slices of (the masters first)."""
    header, start = safetensors_header(path)
    return tensor_places(header, start), _recorded_crcs(path, header), _recorded_keys(path, header)


def _recorded_keys(path: Path, header: dict) -> tuple[str, ...]:
    metadata = header.get("__metadata__") or {}
    text = metadata.get(KEYS_METADATA) if isinstance(metadata, dict) else None
    if text is None:
        return TENSORS
    try:
        keys = json.loads(text)
    except ValueError:
        keys = None
    if (not isinstance(keys, list) or not 0 < len(keys) <= 1 + MAX_STATES or keys[0] != MASTERS
            or not all(isinstance(k, str) and 0 < len(k) <= MAX_NAME and "/" not in k for k in keys)
            or len(set(keys)) != len(keys)):
        raise CheckpointError(f"{path}: its recorded keys are unreadable; the partial checkpoint is corrupt, re-copy it")
    return tuple(keys)


def _recorded_crcs(path: Path, header: dict) -> dict[str, int]:
    metadata = header.get("__metadata__") or {}
    text = metadata.get(CRC_METADATA) if isinstance(metadata, dict) else None
    if text is None:
        return {}
    try:
        crcs = json.loads(text)
        if isinstance(crcs, dict) and all(isinstance(v, int) and 0 <= v < 1 << 32 for v in crcs.values()):
            return crcs
    except (TypeError, ValueError):
        pass
    raise CheckpointError(f"{path}: its recorded CRC-32s are unreadable; the partial checkpoint is corrupt, re-copy it")


def partial_slice(path: Path, tensors: dict, key: str, param: str, length: int) -> tuple:
    """(dtype, shape, first byte, end byte) of one parameter's slice in a partial checkpoint's
    rows file (`tensors`: its safetensors_tensors), checked to hold `length` fp32 elements."""
    name = f"{key}/{param}"
    found = tensors.get(name)
    if found is None:
        raise CheckpointError(f"{path}: has no tensor {name}; the partial checkpoint is incomplete, re-copy it")
    dtype, shape, begin, end = found
    if dtype != "F32" or end - begin < length * 4:
        raise CheckpointError(
            f"{path}: tensor {name} is {dtype} {list(shape)}, expected F32 of at least {length} "
            "elements; the partial checkpoint is from another run or layout"
        )
    return found
