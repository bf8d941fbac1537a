"""Where each parameter lives inside ZeRO-3's per-rank flat buffers.

ZeRO-3 partitions every parameter of `numel` elements into `part = ceil(numel / W)`
elements per rank; rank r holds elements [r*part, (r+1)*part) of the flattened
parameter, the last ranks padded. A rank's flat buffer for one sub-group is the
concatenation of the parts of the sub-group's parameters in `param_shapes` order,
and exp_avg / exp_avg_sq use the same offsets. Stage 3 adds no padding at group
ends. (Checked against DeepSpeed's own zero_to_fp32.)
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import cached_property

from .ds_format import DP_WORLD_SIZE, FROZEN_PARAM_SHAPES, PARAM_SHAPES


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
        return max(0, min(self.part, self.numel - rank * self.part))


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

    @cached_property
    def slots(self) -> tuple[Slot, ...]:
        slots = []
        for g, group in enumerate(self.groups):
            offset = 0
            for name, shape in group:
                numel = math.prod(shape)
                part = math.ceil(numel / self.world_size)
                slots.append(Slot(name, g, offset, part, numel))
                offset += part
        return tuple(slots)

    def group_sizes(self) -> list[int]:
        """Elements per rank in each sub-group's flat buffer."""
        sizes = [0] * len(self.groups)
        for s in self.slots:
            sizes[s.group] += s.part
        return sizes

    def param_names(self) -> list[str]:
        return [s.name for s in self.slots] + [name for name, _ in self.frozen]

    def describe_difference(self, other: "ZeroLayout") -> str | None:
        """One phrase saying how `other` differs from this layout, or None if equal."""
        if other.world_size != self.world_size:
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
        if len(other.groups) != len(self.groups):
            return f"{len(other.groups)} optimizer sub-groups, the base has {len(self.groups)}"
        for g, (a, b) in enumerate(zip(self.groups, other.groups)):
            if [n for n, _ in a] != [n for n, _ in b]:
                return f"a different parameter order in optimizer sub-group {g}"
        return None


def _more(names: list[str]) -> str:
    return f" and {len(names) - 1} more" if len(names) > 1 else ""
