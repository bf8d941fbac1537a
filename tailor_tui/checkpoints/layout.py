"""Where each parameter lives inside ZeRO-3's per-rank flat buffers.

ZeRO-3 partitions every parameter of `numel` elements into `part = ceil(numel / W)`
elements per rank; rank r holds elements [r*part, (r+1)*part) of the flattened
parameter, the last ranks padded. A rank's flat buffer for one sub-group is the
concatenation of the parts of the sub-group's parameters in `param_shapes` order,
and exp_avg / exp_avg_sq use the same offsets. Stage 3 adds no padding at group
ends. (Checked against DeepSpeed's own zero_to_fp32.)

Resharding (`--world-size`) needs two more rules of DeepSpeed's, both here: which elements of
a parameter another world size puts on each rank (`pieces`), and how stage 3 splits each
optimizer param group into sub-groups of about `sub_group_size` elements per rank
(`sub_groups`, DeepSpeed's `DeepSpeedZeroOptimizer_Stage3._create_fp16_sub_groups`).
"""

from __future__ import annotations

import bisect
import math
from dataclasses import dataclass
from functools import cached_property

from tailor_tui.formats.ds_format import DP_WORLD_SIZE, FROZEN_PARAM_SHAPES, PARAM_SHAPES


@dataclass(frozen=True)
class Slot:
    """One trainable parameter's place in every rank's flat buffer of its sub-group."""

    name: str
    group: int
    offset: int  # start of this parameter's part inside the rank's group buffer
    part: int  # elements per rank, padding included
    numel: int

    def valid(self, rank: int) -> int:
        """Elements of real data (not padding) that `rank` holds."""
        return valid_elements(self.numel, self.part, rank)


def part(numel: int, world_size: int) -> int:
    """Elements per rank, padding included, of a parameter of `numel` elements."""
    return math.ceil(numel / world_size)


def valid_elements(numel: int, each: int, rank: int) -> int:
    """Elements of real data (not padding) `rank` holds of a parameter of `numel` elements
    partitioned `each` (its `part`) per rank."""
    return max(0, min(each, numel - rank * each))


def pieces(numel: int, from_world: int, to_world: int, to_rank: int) -> list[tuple[int, int, int, int]]:
    """Where the elements `to_rank` holds at world size `to_world` lie at world size `from_world`:
    [(rank there, first element in that rank's part, first element in to_rank's part, count)],
    in order; together they cover to_rank's real elements (its padding is not listed)."""
    size, theirs = part(numel, to_world), part(numel, from_world)
    first, end = to_rank * size, min(numel, (to_rank + 1) * size)
    found, x = [], first
    while x < end:
        rank = x // theirs
        stop = min(end, (rank + 1) * theirs)
        found.append((rank, x - rank * theirs, x - first, stop - x))
        x = stop
    return found


def sub_groups(params: list, world_size: int, sub_group_size: int) -> list[list]:
    """DeepSpeed's split of one optimizer param group (`params`: (name, shape), in order) into
    sub-groups at `world_size`: a sub-group closes once its parameters' parts add up to at least
    `sub_group_size` elements, and at the group's last parameter."""
    total = sum(part(math.prod(shape), world_size) for _name, shape in params)
    if sub_group_size >= total:
        return [list(params)]
    found, current, count = [], [], 0
    for i, param in enumerate(params):
        current.append(param)
        count += part(math.prod(param[1]), world_size)
        if count >= sub_group_size or i == len(params) - 1:
            found.append(current)
            current, count = [], 0
    return found


@dataclass(frozen=True)
class ZeroLayout:
    world_size: int
    groups: tuple[tuple[tuple[str, tuple[int, ...]], ...], ...]  # per sub-group: (name, shape)
    frozen: tuple[tuple[str, tuple[int, ...]], ...]

    @classmethod
    def from_model_states(cls, states: dict) -> "ZeroLayout":
        groups = tuple(
            tuple((name, tuple(int(d) for d in shape)) for name, shape in group.items())
            for group in states[PARAM_SHAPES]
        )
        frozen = tuple(
            (name, tuple(int(d) for d in shape))
            for name, shape in (states.get(FROZEN_PARAM_SHAPES) or {}).items()
        )
        return cls(int(states[DP_WORLD_SIZE]), groups, frozen)

    def frozen_valid(self, rank: int) -> dict[str, int]:
        """{frozen parameter: elements of real data `rank` holds of it}: ZeRO-3 partitions a frozen
        parameter as a trainable one (`part` per rank), and the padding of its last fragments is never
        written (uninitialised memory, NaN at times): what counts values must stop at this."""
        return {name: valid_elements(math.prod(shape), part(math.prod(shape), self.world_size), rank)
                for name, shape in self.frozen}

    @cached_property
    def slots(self) -> tuple[Slot, ...]:
        slots = []
        for g, group in enumerate(self.groups):
            offset = 0
            for name, shape in group:
                numel = math.prod(shape)
                size = part(numel, self.world_size)
                slots.append(Slot(name, g, offset, size, numel))
                offset += size
        return tuple(slots)

    @cached_property
    def _changes(self) -> tuple[int, ...]:
        """The ranks where some slot's `valid` changes: from its full part to its remainder, and to 0."""
        return tuple(sorted({min(self.world_size, s.numel // s.part + k) for s in self.slots if s.part for k in (0, 1)}))

    def same_holdings(self, rank: int) -> int:
        """A number shared by the ranks that hold the same real elements (`Slot.valid`) of every slot:
        all but a few ranks of a real model's (the last ones carry the padding)."""
        return bisect.bisect_right(self._changes, rank)

    def group_sizes(self) -> list[int]:
        """Elements per rank in each sub-group's flat buffer."""
        return list(self.sizes_per_group)

    @cached_property
    def sizes_per_group(self) -> tuple[int, ...]:
        """`group_sizes`, worked out once (it is asked for every rank of every checkpoint)."""
        sizes = [0] * len(self.groups)
        for s in self.slots:
            sizes[s.group] += s.part
        return tuple(sizes)

    def regrouped(self, world_size: int, param_groups: tuple[tuple[int, ...], ...],
                  sub_group_size: int) -> tuple["ZeroLayout", tuple[tuple[int, ...], ...]]:
        """This layout as DeepSpeed lays the same parameters out at `world_size`: each optimizer
        param group (`param_groups`: the sub-groups it holds here) split again into sub-groups
        by `sub_groups`. Returns the layout and the sub-groups of each param group in it."""
        groups: list[tuple[tuple[str, tuple[int, ...]], ...]] = []
        members: list[tuple[int, ...]] = []
        for held in param_groups:
            params = [p for g in held for p in self.groups[g]]
            split = sub_groups(params, world_size, sub_group_size) if params else []
            members.append(tuple(range(len(groups), len(groups) + len(split))))
            groups += [tuple(s) for s in split]
        return ZeroLayout(world_size, tuple(groups), self.frozen), tuple(members)

    def param_names(self) -> list[str]:
        return [s.name for s in self.slots] + [name for name, _ in self.frozen]

    def describe_difference(self, other: "ZeroLayout", *, repartitioned: bool = False) -> str | None:
        """One phrase saying how `other` differs from this layout, or None if equal.
        `repartitioned`: every parameter is located in `other` by its own layout (resharding),
        so only the parameters (names, shapes, which are frozen) must agree."""
        if other.world_size != self.world_size and not repartitioned:
            return f"world size {other.world_size}, the base has {self.world_size}"
        mine = dict(p for g in self.groups for p in g) | dict(self.frozen)
        theirs = dict(p for g in other.groups for p in g) | dict(other.frozen)
        missing = [n for n in mine if n not in theirs]
        if missing:
            return f"no parameter {missing[0]} (the base has it)" + _more(missing)
        extra = [n for n in theirs if n not in mine]
        if extra:
            return f"parameter {extra[0]}, which the base does not have" + _more(extra)
        for name, shape in mine.items():
            if theirs[name] != shape:
                return f"{name} has shape {list(theirs[name])}, the base {list(shape)}"
        if dict(other.frozen).keys() != dict(self.frozen).keys():
            return "a different set of frozen parameters"
        if repartitioned:
            return None
        if len(other.groups) != len(self.groups):
            return f"{len(other.groups)} optimizer sub-groups, the base has {len(self.groups)}"
        for g, (a, b) in enumerate(zip(self.groups, other.groups)):
            if [n for n, _ in a] != [n for n, _ in b]:
                return f"a different parameter order in optimizer sub-group {g}"
        return None


def _more(names: list[str]) -> str:
    return f" and {len(names) - 1} more" if len(names) > 1 else ""
