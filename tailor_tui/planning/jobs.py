"""The jobs of a composition: what a worker is asked to do, in full, picklable (`events.Job`).

The plan (`plan.ComposePlan`, `file_plan`) makes one job per output rank and per weight file; a
worker process (`workers`) runs the writer for it (`rank_task.compose_rank`,
`model_files.compose_model_file`, `bin_files.compose_bin_file`) and reports through `events`
(progress, finished, failed). A job holds everything its writer needs; the writer never calls
back into the plan.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import NamedTuple, Protocol

from tailor_tui.checked.crc import RecordBlocks
from tailor_tui.events import JobCost, RankJobCost
from tailor_tui.formats.ds_format import TENSORS
from tailor_tui.formats.ptfile import file_format
from tailor_tui.formats.safetensors_in import parse_prefix
from tailor_tui.kinds.base import RankFiles, WeightSource
from tailor_tui.kinds.hf_weights import BinWeights

# How an output rank's optim file is written (`optim_writer`): built from a partial base's skeleton, torch-free
# (`rank_partial`); the base's bytes with ranges replaced (`rank_stream`); re-serialised by torch (`rank_torch`)
SKELETON, STREAM, TORCH = "skeleton", "stream", "torch"


def optim_writer(base: RankFiles) -> str:
    """How the output's optim file of a rank whose base files are `base` is written, by their kind: the one
    rule the writer (`rank_task`), the workers' memory (`team.workers`) and the plan's count of files torch
    writes follow. (`STREAM` falls back to `TORCH` where the archive is laid out in a way it does not handle.)"""
    if not base.whole_records:  # its state in slices: no archive to stream from
        return SKELETON
    return STREAM if file_format(base.optim_states) == "zip" else TORCH


@dataclass(frozen=True)
class SliceCopy:
    """Copy `length` elements at `offset` of sub-group `group` from source `source`."""

    group: int
    offset: int
    length: int
    source: int
    param: str | None = None  # set when the source is partial: its slices are stored per parameter


class RowSlot(NamedTuple):
    """Where a row's parameter lies in the output's flat buffers on one rank, and its source."""

    row: str
    param: str
    group: int
    offset: int
    valid: int  # elements of real data (padding excluded)
    source: int


class FrozenRow(NamedTuple):
    """A frozen parameter's fragment on one rank, its row and source."""

    row: str
    param: str
    source: int
    valid: int  # elements of real data: the fragment's padding is never written (`ZeroLayout.frozen_valid`)


@dataclass(frozen=True)
class RankJob(RankJobCost):
    """Everything one worker needs to compose one rank's files (picklable)."""

    rank: int
    files: dict[int, RankFiles]  # source index -> that checkpoint's files of this rank; 0 is base
    group_sizes: tuple[int, ...]
    copies: tuple[SliceCopy, ...]  # slices that do not come from the base
    padding: tuple[tuple[int, int, int], ...]  # (group, offset, length): zeros in the output; neighbours joined
    frozen: tuple[tuple[str, int], ...]  # frozen params taken from a non-base source
    buffers: tuple[tuple[str, int], ...]  # buffers taken from a non-base source
    read_bytes: int
    write_bytes: int
    # every trainable parameter's slice and every frozen parameter (row, name, source): what
    # the writers count non-finite values of, per row
    row_slots: tuple[RowSlot, ...] = ()
    frozen_rows: tuple[FrozenRow, ...] = ()
    # (source, a record's block CRC-32s): what the run's statistics recorded of the full sources' optim
    # files, where a cloned composition reads only the blocks it takes (`compose.source_blocks`); the
    # plan's jobs have none, a cloned composition's are given them before any task starts (`reads`)
    source_blocks: tuple[tuple[int, RecordBlocks], ...] = ()
    # the checkpoints (0: the base) every row of which this rank keeps or takes the run's statistics found
    # whole and finite in their files of this rank, as the files are: the writer reads and checks their
    # bytes against their CRC-32s (which prove them the bytes the statistics counted) without counting
    # their NaN/Inf again; the plan's jobs have none, a cloned composition's are given them (`reads`)
    vouched: frozenset[int] = frozenset()
    # the flat tensors of every sub-group a slice lies in, on every source alike (`RankReader.keys`): the fp32
    # masters first, then the optimizer's state kept per element
    keys: tuple[str, ...] = TENSORS


class _HasSize(Protocol):
    @property
    def size(self) -> int: ...


class WeightFileCost(JobCost):
    """A job that composes one weight file (`size` bytes): it reads as much as it writes."""

    @property
    def read_bytes(self: _HasSize) -> int:
        return self.size

    @property
    def write_bytes(self: _HasSize) -> int:
        return self.size


@dataclass(frozen=True)
class ModelFileJob(WeightFileCost):
    """Everything one worker needs to compose one 16-bit model file (picklable)."""

    name: str  # file name in the output
    prefix: bytes  # the output's 8-byte length + header (the base's)
    base_file: Path | None  # whose bytes stay where the base's rows are kept; None: a partial base
    sources: dict[str, int]  # tensor -> source index: its row's pick (a tied tensor's partner's row)
    rows: dict[str, str]  # tensor -> its row ("" for a tensor of no row, kept from the base)
    # the sources picked (and a partial base): where each tensor lies in them, as their kind says (`kinds`: a full
    # HF save's files of the same tensors, a partial save's fp32 masters)
    weights: dict[int, WeightSource]
    source_names: dict[int, str]  # for messages
    # tensor -> the parameter or buffer it holds, where the file names it otherwise (transformers 5's
    # saved names, `weight_files.tensor_params`): how a partial source's values are found
    params: dict[str, str] = field(default_factory=dict)

    @property
    def task(self) -> str:
        return "model file" if self.name == "model.safetensors" else self.name

    def source_paths(self) -> tuple[Path, ...]:
        """Every file of its sources it may read (not the base's file)."""
        return tuple(f for source in self.weights.values() for f in source.files)

    @property
    def loads_states(self) -> bool:
        """Whether it may load a source's model_states with torch (a partial save's frozen parameters)."""
        return any(source.loads_states for source in self.weights.values())

    @property
    def size(self) -> int:
        return max((end for *_x, end in parse_prefix(self.prefix).values()), default=len(self.prefix))


@dataclass(frozen=True)
class BinFileJob(WeightFileCost):
    """Everything one worker needs to compose one torch-format weight file (picklable)."""

    name: str  # relative path in the output (and in the base)
    base_file: Path
    sources: dict[str, int]  # tensor -> source index: its row's pick
    rows: dict[str, str]  # tensor -> its row
    weights: dict[int, BinWeights]  # the sources that are picked: their files of this family (`kinds`)
    source_names: dict[int, str]  # for messages
    size: int  # bytes of the base's file (the output's, but for its serialization id)

    @property
    def task(self) -> str:
        return self.name

    def source_paths(self) -> tuple[Path, ...]:
        """Every file of its sources it may read (not the base's file)."""
        return tuple(f for source in self.weights.values() for f in source.files)

    @property
    def loads_states(self) -> bool:
        return False


WeightJob = ModelFileJob | BinFileJob
