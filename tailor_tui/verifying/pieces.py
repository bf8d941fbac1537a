"""Where every element of a resharded output must come from, worked out by the verifier itself.

ZeRO-3 partitions a parameter of `numel` elements into `part = ceil(numel / W)` elements per
rank: rank r holds elements [r*part, r*part + valid) of the flattened parameter, valid =
min(part, numel - r*part) (none past the end), then zeros up to `part`. An output rank's part of
a parameter at the output's world size is therefore cut from the parts of the source's ranks at
the source's own world size: each run of elements that lies on one source rank is one piece, and
the rest of the output's part is padding. Trainable parameters lie in a sub-group's flat tensors
(fp32, exp_avg, exp_avg_sq) at their slot's offset, on the output (the plan's DeepSpeed layout at
the new world size) and on each source (its own layout); frozen parameters in a fragment of their own.

Nothing here is taken from the plan's jobs, which the writers fill the output from: only what
the recipe asked (which source each parameter comes from) and each checkpoint's layout.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, NamedTuple

if TYPE_CHECKING:
    from tailor_tui.planning.plan import ComposePlan

ZEROS = -1  # a piece's source when it is padding
FROZEN = -1  # a piece's group when it lies in a frozen parameter's fragment


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
    whole: int = 0  # the real elements of the parameter's part on that source rank


def _part(numel: int, world_size: int) -> int:
    return -(-numel // world_size)


class _Parameter:
    """One parameter: where it lies in the output (`at`, in the output tensor) and in its source
    (`group`, `offset` on each of the source's ranks)."""

    def __init__(self, name: str, *, row: str, numel: int, to_world: int, at: int, source: int,
                 from_world: int, group: int, offset: int):
        self.name, self.row, self.numel, self.at = name, row, numel, at
        self.source, self.group, self.offset = source, group, offset
        self.size, self.theirs = _part(numel, to_world), _part(numel, from_world)
        self.padding = (Piece(at, self.size, ZEROS, 0, FROZEN, 0, 0, name, row),)  # a rank past its elements

    def pieces(self, rank: int) -> tuple[Piece, ...] | list[Piece]:
        first = rank * self.size
        end = min(self.numel, first + self.size)
        if first >= end:
            return self.padding
        found, x, theirs = [], first, self.theirs
        while x < end:
            their_rank = x // theirs
            stop = min(end, (their_rank + 1) * theirs)
            within = x - their_rank * theirs
            found.append(Piece(self.at + x - first, stop - x, self.source, their_rank, self.group,
                               self.offset + within, within, self.name, self.row,
                               max(0, min(theirs, self.numel - their_rank * theirs))))
            x = stop
        if end - first < self.size:
            found.append(Piece(self.at + end - first, self.size - (end - first), ZEROS, 0, FROZEN, 0, 0,
                               self.name, self.row))
        return found


class OutputPieces:
    """The pieces of every output rank of a resharded plan: `groups(rank)`, per output sub-group,
    and `frozen(rank)`, per frozen parameter. Each parameter's facts are worked out once."""

    def __init__(self, plan: ComposePlan) -> None:
        reshard, owner, source_of = plan.reshard, plan.base.param_to_row(), plan.source_of_param()
        if reshard is None:
            raise ValueError("OutputPieces: the plan composes into the base's world size (no pieces to move)")
        theirs = [{slot.name: slot for slot in src.layout.slots} for src in plan.sources]
        self.world_size = reshard.world_size
        self.trainable: list[list[_Parameter]] = [[] for _ in reshard.layout.groups]
        for slot in reshard.layout.slots:
            s = source_of[slot.name]
            there = theirs[s][slot.name]
            self.trainable[slot.group].append(_Parameter(
                slot.name, row=owner[slot.name], numel=slot.numel, to_world=reshard.world_size, at=slot.offset,
                source=s, from_world=plan.sources[s].world_size, group=there.group, offset=there.offset))
        self.frozen_params = [
            _Parameter(name, row=owner[name], numel=math.prod(shape), to_world=reshard.world_size, at=0,
                       source=source_of[name], from_world=plan.sources[source_of[name]].world_size, group=FROZEN,
                       offset=0)
            for name, shape in plan.base.layout.frozen]

    def groups(self, rank: int) -> list[list[Piece]]:
        found = []
        for params in self.trainable:
            pieces: list[Piece] = []
            for param in params:
                pieces += param.pieces(rank)
            found.append(pieces)
        return found

    def frozen(self, rank: int) -> list[tuple[str, list[Piece]]]:
        return [(param.name, list(param.pieces(rank))) for param in self.frozen_params]
