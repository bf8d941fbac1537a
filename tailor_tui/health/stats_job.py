"""What a statistics worker is given (`StatsJob`) and gives back (`RankStats`): picklable and
numpy-free, so the process that plans the work and reads the cache (`stats_run`) does not load
numpy; only `stats_rank`, in the workers, does the arithmetic.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from tailor_tui.checked.crc import BLOCK, RecordBlocks
from tailor_tui.checkpoints.checkpoint import RankFiles
from tailor_tui.checkpoints.layout import ZeroLayout
from tailor_tui.events import JobCost


@dataclass(frozen=True)
class SlotRead:
    """One parameter's slice on this rank, its previous checkpoint's slice of the same place."""

    row: str
    param: str
    group: int
    offset: int  # elements into the rank's flat buffer of `group`
    valid: int  # elements of real data (padding excluded)


@dataclass(frozen=True)
class SlotTable:
    """The trainable parameters of the rows read, as columns: where each lies in every rank's flat
    buffers (`Slot`), which row it is of. Made once per checkpoint and shared by its ranks' jobs
    (pickled once per batch of them); a rank's slices follow from its rank (`stats_flat`)."""

    rows: tuple[str, ...]  # the rows read; `row` indexes them
    row: tuple[int, ...]
    group: tuple[int, ...]
    offset: tuple[int, ...]
    part: tuple[int, ...]
    numel: tuple[int, ...]

    @classmethod
    def of(cls, layout: ZeroLayout, owner: dict, rows) -> "SlotTable":
        names = tuple(sorted(rows))
        index = {name: i for i, name in enumerate(names)}
        columns: tuple[list, ...] = ([], [], [], [], [])
        for s in layout.slots:
            if (i := index.get(owner.get(s.name))) is not None:
                for column, value in zip(columns, (i, s.group, s.offset, s.part, s.numel)):
                    column.append(value)
        return cls(names, *(tuple(column) for column in columns))


@dataclass(frozen=True)
class StatsJob(JobCost):
    """Everything one worker needs for one rank of one checkpoint (picklable); it only reads."""

    key: str  # the cache key: identities of every file read and what is read of them
    checkpoint: int
    label: str  # the checkpoint's, distinct among the checkpoints read (progress lines)
    rank: int
    files: RankFiles
    layout: ZeroLayout
    owner: dict  # parameter -> row
    rows: frozenset  # the rows to read
    frozen: tuple[tuple[str, str], ...]  # (row, parameter) of frozen parameters
    prev: tuple[tuple[str, RankFiles], ...]  # (row, this rank's files of the row's previous checkpoint)
    read_bytes: int
    table: SlotTable | None = None  # the rows' slots, for reading the flat tensors all at once
    crc_block: int = BLOCK  # the size of the blocks whose CRC-32s are recorded (`crc.BlockCrcs`)

    @property
    def task(self) -> str:
        return f"{self.label} rank {self.rank}"

    @property
    def write_bytes(self) -> int:
        return 0  # statistics only read

    @property
    def group_sizes(self) -> tuple[int, ...]:
        return self.layout.sizes_per_group

    def files_read(self) -> tuple[Path, ...]:
        """Every file the job may read: this rank's files and those of its rows' previous checkpoints."""
        return tuple(dict.fromkeys(f for files in (self.files, *(files for _row, files in self.prev))
                                   for f in files.existing()))

    def slots(self) -> tuple[SlotRead, ...]:
        """Each trainable parameter's slice on this rank, of the rows to read."""
        found = []
        for s in self.layout.slots:
            if (valid := s.valid(self.rank)) and (row := self.owner.get(s.name)) is not None and row in self.rows:
                found.append(SlotRead(row, s.name, s.group, s.offset, valid))
        return tuple(found)


@dataclass
class RowSums:
    """A row's sums over one rank (or, added up, over all)."""

    nonfinite: int = 0
    count: int = 0  # fp32 master elements
    sumsq: float = 0.0  # of the finite masters
    v_max: float | None = None  # of the finite exp_avg_sq
    diff_sq: float = 0.0  # ||θ − θ_prev||² over elements finite in both
    prev_sq: float = 0.0  # ||θ_prev||²
    prev_nonfinite: int = 0
    has_prev: bool = False
    crc_ok: bool = True

    def add(self, other: "RowSums") -> None:
        self.nonfinite += other.nonfinite
        self.count += other.count
        self.sumsq += other.sumsq
        if other.v_max is not None:
            self.v_max = other.v_max if self.v_max is None else max(self.v_max, other.v_max)
        self.diff_sq += other.diff_sq
        self.prev_sq += other.prev_sq
        self.prev_nonfinite += other.prev_nonfinite
        self.has_prev = self.has_prev or other.has_prev
        self.crc_ok = self.crc_ok and other.crc_ok

    def to_json(self) -> list:
        return [self.nonfinite, self.count, self.sumsq, self.v_max, self.diff_sq, self.prev_sq,
                self.prev_nonfinite, self.has_prev, self.crc_ok]

    @classmethod
    def from_json(cls, values: list) -> "RowSums":
        """The sums `to_json` wrote; ValueError or TypeError for anything else (a cache entry is an input)."""
        nonfinite, n, sumsq, v_max, diff_sq, prev_sq, prev_nonfinite, has_prev, crc_ok = values
        if not (all(type(v) is int and v >= 0 for v in (nonfinite, n, prev_nonfinite))
                and all(type(v) in (int, float) for v in (sumsq, diff_sq, prev_sq))
                and (v_max is None or type(v_max) in (int, float))
                and type(has_prev) is bool and type(crc_ok) is bool):
            raise ValueError("not a row's sums")
        return cls(nonfinite, n, float(sumsq), None if v_max is None else float(v_max), float(diff_sq),
                   float(prev_sq), prev_nonfinite, has_prev, crc_ok)


@dataclass(frozen=True)
class RankStats:
    """What one rank found: per row its sums, and why the rank could not be read at all; of a full
    checkpoint's optim file, the block CRC-32s of each record that passed its CRC-32 check (by name)."""

    rows: dict[str, RowSums] = field(default_factory=dict)
    error: str | None = None
    blocks: dict[str, RecordBlocks] = field(default_factory=dict)


@dataclass(frozen=True)
class RankStatsRead:
    """A rank's statistics, emitted by the worker as soon as it has them."""

    key: str  # the job's
    stats: RankStats
