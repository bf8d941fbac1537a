"""Planning a composition into another data-parallel world size (`--world-size M`).

The output is what DeepSpeed at world size M would save after loading this state: every
parameter re-partitioned (`layout.pieces`), each optimizer param group split into sub-groups
again by DeepSpeed's rule for M (`layout.sub_groups`), with the `sub_group_size` the run
trained with. That size is read from the DeepSpeed config the base's model_states records
(a dict, or the JSON file it names), and is always checked to give the base's own sub-groups
at the base's world size: a config that does not reproduce them is refused, not trusted.
Without a readable config, the sizes consistent with the base's sub-groups are used when
they all give the same sub-groups at M.

Each output rank's job lists, for each of its sub-groups and frozen parameters, the pieces
that fill it in order: a range of some source rank's tensor, or zeros (padding). Every
source, whatever its own world size, is located by its own layout.
"""

from __future__ import annotations

import bisect
import math
import re
from dataclasses import dataclass
from pathlib import Path
from typing import NamedTuple

from tailor_tui.checkpoints.checkpoint import Checkpoint, RankFiles
from tailor_tui.checkpoints.layout import ZeroLayout, part, pieces, valid_elements
from tailor_tui.checkpoints.model_states import read_metadata
from tailor_tui.checkpoints.side_files import load_json
from tailor_tui.errors import CheckpointError
from tailor_tui.events import RankJobCost
from tailor_tui.formats.ds_format import (
    DS_CONFIG,
    MODEL_STATES,
    OPTIM_STATES,
    OPTIMIZER_STATE_DICT,
    PARAM_GROUPS,
    TENSORS,
    bytes_per_element,
)
from tailor_tui.formats.dtypes import BY_NAME, PRECISION
from tailor_tui.formats.ptfile import read_structure

DEFAULT_SUB_GROUP_SIZE = 1_000_000_000  # DeepSpeed's default (zero_optimization.sub_group_size)
ZEROS = -1  # a piece's source when it is padding
FROZEN = -1  # a piece's group when it lies in a frozen parameter's fragment
ITEMSIZE = {p: BY_NAME[name].itemsize for p, name in PRECISION.items()}  # a frozen fragment's, by the run's dtype (an estimate)


class Piece(NamedTuple):
    """Elements [at, at+length) of an output tensor: from a source rank's tensor, or zeros."""

    at: int
    length: int
    source: int  # index into the plan's sources; ZEROS: padding
    rank: int  # the source's rank whose files hold them
    group: int  # the source's sub-group (its flat tensors); FROZEN: a frozen fragment
    offset: int  # first element in that tensor (flat group, or fragment)
    within: int  # first element within the parameter's part on that rank (a partial's slices are stored so)
    param: str
    row: str
    whole: int = 0  # the real elements of the parameter's part on that rank (a partial's recorded CRC covers them)


@dataclass(frozen=True)
class Reshard:
    """The output's world size and ZeRO layout, and how its sub-groups were formed."""

    world_size: int
    layout: ZeroLayout
    param_groups: tuple[tuple[int, ...], ...]  # the output's sub-groups of each optimizer param group
    sub_group_size: int | None  # None: not known, every size the base's sub-groups allow gives the same
    sub_group_size_from: str  # where it was read, for the plan

    def describe(self, base: Checkpoint) -> str:
        size = f"{self.sub_group_size:,}" if self.sub_group_size is not None else "not recorded"
        return (f"{base.world_size} → {self.world_size} ranks; {len(self.layout.groups)} optimizer sub-group(s) "
                f"(the base has {len(base.layout.groups)}), sub_group_size {size} ({self.sub_group_size_from})")


@dataclass(frozen=True)
class ReshardJob(RankJobCost):
    """Everything one worker needs to fill output rank `rank`'s two files (picklable). Their
    structure is written beforehand (`reshard_skeleton`); the worker fills the big tensors."""

    rank: int
    model_states: str  # the output's file names
    optim_states: str
    files: dict  # (source, source rank) -> RankFiles, of every source rank a piece comes from
    source_sizes: dict  # source -> its group sizes (elements per rank of each of its sub-groups)
    group_sizes: tuple[int, ...]  # the output's
    groups: tuple[tuple[Piece, ...], ...]  # per output sub-group: the pieces filling it, in order
    frozen: tuple[tuple[str, tuple[Piece, ...]], ...]  # (frozen parameter, the pieces of its fragment)
    read_bytes: int
    write_bytes: int
    # the (source, source rank) files whose records this job reads whole to check their stored CRC-32s:
    # each full file is checked by one job, the first to take from it, every flat tensor and frozen
    # fragment of it; the others read only their pieces (M output ranks read their sources once, not M
    # times). A partial checkpoint's files are listed in every job taking from them: each checks the
    # slices it takes from against their recorded CRC-32s.
    verifies: frozenset = frozenset()
    # the flat tensors of every sub-group a piece lies in, on every source alike (`RankReader.keys`): the fp32
    # masters first, then the optimizer's state kept per element
    keys: tuple[str, ...] = TENSORS


def optim_structure_file(files: RankFiles) -> Path:
    """The file holding a rank's optimizer state structure (`RankFiles.structure_file`)."""
    return files.structure_file


def param_groups_of(ckpt: Checkpoint) -> tuple[tuple[int, ...], ...]:
    """The sub-groups of each optimizer param group, as rank 0's optimizer state lists them."""
    path = optim_structure_file(ckpt.ranks[0])
    obj, _records, _prefix = read_structure(path)
    try:
        groups = obj[OPTIMIZER_STATE_DICT][OPTIMIZER_STATE_DICT][PARAM_GROUPS]
        found = tuple(tuple(int(i) for i in group["params"]) for group in groups)
    except (KeyError, TypeError, ValueError, AttributeError):
        raise CheckpointError(f"{path}: its optimizer state has no param groups listing its sub-groups; "
                              "it is not a ZeRO-3 optimizer state tailor-tui can reshard") from None
    if [i for group in found for i in group] != list(range(len(ckpt.layout.groups))):
        raise CheckpointError(f"{path}: its param groups hold sub-groups {[list(g) for g in found]}, not each of "
                              f"its {len(ckpt.layout.groups)} sub-groups once and in order; tailor-tui cannot "
                              "tell how DeepSpeed would group them at another world size")
    return found


def _config(ckpt: Checkpoint) -> tuple[dict | None, str]:
    """The DeepSpeed config the run trained with, and where it was found (None: not readable)."""
    states = read_metadata(ckpt.ranks[0].model_states)
    config = states.get(DS_CONFIG)
    if isinstance(config, dict):
        return config, "the DeepSpeed config model_states records"
    if isinstance(config, str) and config:
        path = Path(config).expanduser()
        try:
            found = load_json(path)
        except OSError as exc:
            return None, f"the config file {path} model_states names is gone or unreadable ({exc.strerror or exc})"
        except ValueError as exc:
            return None, f"the config file {path} model_states names is not one ({exc})"
        if isinstance(found, dict):
            return found, f"the config file {path} model_states names"
        return None, f"the config file {path} model_states names is not a JSON object"
    return None, "model_states records no DeepSpeed config"


def _configured_size(config: dict) -> int | None:
    zero = config.get("zero_optimization")
    value = zero.get("sub_group_size", DEFAULT_SUB_GROUP_SIZE) if isinstance(zero, dict) else DEFAULT_SUB_GROUP_SIZE
    try:
        size = int(float(value))
    except (TypeError, ValueError, OverflowError):
        return None
    return size if size >= 0 else None


def consistent_sizes(layout: ZeroLayout, param_groups) -> tuple[int, float]:
    """The range [lo, hi] of sub_group_size values under which DeepSpeed forms exactly the
    sub-groups of `layout` (hi: math.inf when no sub-group was closed by the size)."""
    lo, hi = 0, math.inf
    parts = [[part(math.prod(shape), layout.world_size) for _name, shape in group] for group in layout.groups]
    for held in param_groups:
        for k, g in enumerate(held):
            if not parts[g]:
                continue
            total = sum(parts[g])
            lo = max(lo, total - parts[g][-1] + 1)  # it did not close before its last parameter
            if k < len(held) - 1:
                hi = min(hi, total)  # it closed at its last parameter
    return lo, hi


def plan_reshard(base: Checkpoint, world_size: int) -> Reshard:
    """The output layout at `world_size` (CheckpointError when it cannot be told)."""
    groups = param_groups_of(base)
    config, where = _config(base)
    size = _configured_size(config) if config is not None else None
    if size is not None:
        again, _ = base.layout.regrouped(base.world_size, groups, size)
        if again.groups != base.layout.groups:
            raise CheckpointError(
                f"{base.path}: its {len(base.layout.groups)} optimizer sub-groups are not what DeepSpeed makes of "
                f"sub_group_size {size:,} ({where}) at its world size {base.world_size}; tailor-tui will not guess "
                "how it would group them at another world size")
        layout, members = base.layout.regrouped(world_size, groups, size)
        return Reshard(world_size, layout, members, size, where)
    lo, hi = consistent_sizes(base.layout, groups)
    low = base.layout.regrouped(world_size, groups, lo)
    high = base.layout.regrouped(world_size, groups, DEFAULT_SUB_GROUP_SIZE * 1000 if hi == math.inf else int(hi))
    if low != high:
        raise CheckpointError(
            f"{base.path}: cannot tell the run's sub_group_size ({where}), and the sizes its sub-groups allow "
            f"({lo:,} to {'any larger' if hi == math.inf else f'{hi:,}'}) group the parameters differently at "
            f"world size {world_size}; put the training's DeepSpeed config back where model_states names it")
    return Reshard(world_size, low[0], low[1], None, f"{where}; every size its sub-groups allow gives these")


def check_world_size(base: Checkpoint, world_size: int) -> str | None:
    """Why `world_size` is not one to reshard `base` into (one phrase), or None."""
    largest = max((s.numel for s in base.layout.slots), default=0)
    if world_size > largest:
        return (f"world size {world_size} is more than the {largest:,} elements of the model's largest trainable "
                "parameter: every rank past that would hold nothing but padding")
    return None


def output_names(base: Checkpoint, world_size: int) -> tuple[tuple[str, str], ...]:
    """(model_states, optim_states) file names of every output rank."""
    prefix = "bf16_" if base.dtype == "bf16" else ""
    return tuple((MODEL_STATES.format(rank=r), OPTIM_STATES.format(prefix=prefix, rank=r))
                 for r in range(world_size))


def reshard_jobs(base: Checkpoint, sources: tuple[Checkpoint, ...], source_of: dict[str, int],
                 reshard: Reshard, keys: tuple[str, ...] = TENSORS) -> tuple[ReshardJob, ...]:
    """One job per output rank. `source_of`: every parameter -> index into `sources`; `keys`: the flat tensors of
    every sub-group (`ComposePlan.keys`)."""
    owner = base.param_to_row()
    slots = [{s.name: s for s in src.layout.slots} for src in sources]
    names = output_names(base, reshard.world_size)
    itemsize = ITEMSIZE.get(base.dtype, 4)
    out_sizes = tuple(reshard.layout.group_sizes())  # every output rank's, and each source's: once
    source_sizes = [tuple(src.layout.group_sizes()) for src in sources]
    per_element = bytes_per_element(keys)
    written = per_element * sum(out_sizes) + itemsize * sum(part(math.prod(shape), reshard.world_size)
                                                   for _n, shape in base.layout.frozen)
    # each parameter's facts, once: (its pieces' maker, where they go); a rank holding none of its
    # elements gets the one padding piece every such rank shares (most ranks of a wide run, for
    # small parameters: planned and pickled once)
    trainable = []
    for slot in reshard.layout.slots:
        s = source_of[slot.name]
        theirs = slots[s][slot.name]
        trainable.append((_Parameter(slot.name, numel=slot.numel, from_world=sources[s].world_size,
                                     to_world=reshard.world_size, source=s, row=owner[slot.name], group=theirs.group,
                                     offset=theirs.offset, at=slot.offset, cuts=sources[s].ranks[0].cuts(slot.name)),
                          slot.group))
    frozen_params = [_Parameter(name, numel=math.prod(shape), from_world=sources[source_of[name]].world_size,
                                to_world=reshard.world_size, source=source_of[name], row=owner[name], group=FROZEN,
                                offset=0, at=0) for name, shape in base.layout.frozen]
    jobs: list[ReshardJob] = []
    verified: set[tuple[int, int]] = set()  # (source, rank) of the full files a job checks already
    for rank in range(reshard.world_size):
        groups: list[list[Piece]] = [[] for _ in reshard.layout.groups]
        for param, g in trainable:
            groups[g] += param.pieces(rank)
        frozen = [(param.name, tuple(param.pieces(rank))) for param in frozen_params]
        used = {(p.source, p.rank) for g in groups for p in g if p.source != ZEROS}
        used |= {(p.source, p.rank) for _n, ps in frozen for p in ps if p.source != ZEROS}
        files = {(s, r): sources[s].ranks[r] for s, r in sorted(used)}
        sizes = {s: source_sizes[s] for s in sorted({s for s, _r in used})}
        taken = [p for g in groups for p in g if p.source != ZEROS]
        full = {u for u in used if files[u].whole_records}
        verifies = frozenset(full - verified) | {u for u in used if u not in full}  # a partial's: each job its own
        verified |= verifies
        # the files it checks: a full source's records read whole (their stored CRC-32 covers the
        # whole record), a partial source's slices (its recorded CRC-32 covers a slice's real elements)
        slices: dict[tuple[int, int], dict[str, int]] = {}  # per source rank checked: each slice taken from, whole
        for p in taken:
            if (p.source, p.rank) in verifies:
                slices.setdefault((p.source, p.rank), {})[p.param] = p.whole
        read = per_element * sum(files[u].elements_checked(range(len(sizes[u[0]])), sum(slices.get(u, {}).values()),
                                                  sizes[u[0]]) for u in verifies)
        read += per_element * sum(p.length for p in taken if (p.source, p.rank) not in verifies)  # the others: pieces
        read += itemsize * sum(p.length for _n, ps in frozen for p in ps if p.source != ZEROS)
        jobs.append(ReshardJob(rank, *names[rank], files, sizes, out_sizes,
                               tuple(tuple(g) for g in groups), tuple(frozen), read, written, verifies, keys))
    return tuple(jobs)


class _Parameter:
    """One parameter of a reshard: the pieces of its part on each output rank (`pieces`), its
    padding included, at `at` in the output tensor; its elements lie in the source rank's tensor
    at `offset` of sub-group `group` (FROZEN: its fragment)."""

    def __init__(self, name: str, *, numel: int, from_world: int, to_world: int, source: int, row: str,
                 group: int, offset: int, at: int, cuts: tuple[int, ...] = ()):
        self.name, self.numel, self.from_world, self.to_world = name, numel, from_world, to_world
        self.source, self.row, self.group, self.offset, self.at = source, row, group, offset, at
        self.cuts = cuts  # where a piece must be cut, within its source's part (a DCP checkpoint's chunks, one rank)
        self.size, self.theirs = part(numel, to_world), part(numel, from_world)
        self.padding = (Piece(at, self.size, ZEROS, 0, FROZEN, 0, 0, name, row),)  # a rank past its elements

    def pieces(self, rank: int) -> tuple[Piece, ...] | list[Piece]:
        if rank * self.size >= self.numel:
            return self.padding
        found, theirs, numel = [], self.theirs, self.numel
        for their_rank, within, at, count in pieces(numel, self.from_world, self.to_world, rank):
            for start, end in _cut(within, within + count, self.cuts):
                found.append(Piece(self.at + at + start - within, end - start, self.source, their_rank, self.group,
                                   self.offset + start, start, self.name, self.row,
                                   valid_elements(numel, theirs, their_rank)))
        valid = sum(p.length for p in found)
        if valid < self.size:
            found.append(Piece(self.at + valid, self.size - valid, ZEROS, 0, FROZEN, 0, 0, self.name, self.row))
        return found


def _cut(start: int, end: int, cuts: tuple[int, ...]) -> list[tuple[int, int]]:
    """[start, end) cut at every one of `cuts` (sorted) inside it."""
    if not cuts:
        return [(start, end)]
    inside = cuts[bisect.bisect_right(cuts, start): bisect.bisect_left(cuts, end)]
    edges = [start, *inside, end]
    return list(zip(edges, edges[1:]))


RNG_STATE = re.compile(r"^rng_state(?:_(\d+))?\.pth$", re.ASCII)  # ASCII: `rng_state_٣.pth` is no rank 3's
ACCELERATE_RNG_STATE = re.compile(r"^random_states_(\d+)\.pkl$", re.ASCII)  # Accelerate's, one per process


def renamed_for(rel: Path, to_world: int) -> Path | None:
    """Where a file of an HF (or Accelerate) checkpoint goes in an output at another world size
    (None: left out). Accelerate's `random_states_R.pkl` stay for ranks that exist at both sizes.
    The HF Trainer reads `rng_state_R.pth` on process R (`rng_state.pth` on a single
    process): ranks that exist at both sizes keep theirs, a single process takes rank 0's,
    new ranks get none (the Trainer then goes on with their fresh generators and says so in
    its log: two ranks with one RNG state would draw the same dropout masks)."""
    theirs = ACCELERATE_RNG_STATE.match(rel.name) if rel.parent == Path(".") else None
    if theirs is not None:  # Accelerate's load_state skips a process's missing RNG state (it logs so)
        return rel if int(theirs.group(1)) < to_world else None
    found = RNG_STATE.match(rel.name) if rel.parent == Path(".") else None
    if found is None:
        return rel
    rank = int(found.group(1)) if found.group(1) is not None else 0
    if rank >= to_world:
        return None
    return Path("rng_state.pth" if to_world == 1 else f"rng_state_{rank}.pth")
