"""Re-checking a resharded output (`--verify` of a recipe with a world size), claimed byte range by byte range.

For every output rank, each piece of every sub-group's flat tensors (the fp32 masters and the optimizer's state
kept per element), and of every frozen parameter's fragment, equals the elements of the source rank it comes from
(`pieces`: located by each checkpoint's own layout, worked out here, not taken from the plan's jobs the writers
follow), and padding is zero bytes. Everything else must be what DeepSpeed at the new world size would hold: the
base's rank 0 with `partition_count`/`dp_world_size` the new world size, the new `param_shapes` and param groups'
sub-group lists, each new sub-group's state (its `step`) that of the base's sub-group its first parameter came
from, and buffers from their rows' sources. A piece from a PyTorch Distributed Checkpoint (a composition mixing
formats) is found in the chunks its metadata places (`dcp.reading`), each a range of the parameter's elements.

Claims, reading and settling are `rank_claims`': every byte of every file read once, compared as it is read,
whatever the number of ranks or pieces (a 512-rank output of a small model is hundreds of thousands of pieces of a
few elements); a structure shared by many files (a wide run's model_states) is parsed once (`formats.ptfile`).
"""

from __future__ import annotations

from typing import Callable

from tailor_tui.dcp.metadata import MetadataIndex
from tailor_tui.errors import CheckpointError
from tailor_tui.events import Emit
from tailor_tui.formats.ds_format import (
    DP_WORLD_SIZE,
    FP32_FLAT_GROUPS,
    FROZEN_PARAM_FRAGMENTS,
    MODULE,
    OPTIMIZER_STATE_DICT,
    PARAM_GROUPS,
    PARAM_SHAPES,
    PARTITION_COUNT,
    STATE,
    describe_state,
    flat_keys,
    flat_tensor,
    optimizer_state,
)
from tailor_tui.verifying import streamed
from tailor_tui.verifying.compare import structure_differences
from tailor_tui.verifying.dcp_sources import MASTERS, chunk_range, claimed_chunk, is_dcp_rank
from tailor_tui.verifying.pieces import ZEROS, OutputPieces, Piece
from tailor_tui.verifying.rank_claims import MAX_SHOWN, RankClaims, Tag, TorchFile
from tailor_tui.verifying.recorded import FROZEN, Archives

OUTER = f"[{OPTIMIZER_STATE_DICT!r}]"
# paths in an optim file that differ from the base's by design; each is checked on its own
REPLACED = (f"{OUTER}[{FP32_FLAT_GROUPS!r}]", f"{OUTER}{OUTER}[{STATE!r}]", f"{OUTER}[{PARTITION_COUNT!r}]")


class ReshardedRanks(RankClaims):
    """Every output rank of a resharded plan."""

    def __init__(self, plan, report, *, changed: set[int], taken, archives: Archives):
        super().__init__(plan, report, changed=changed, taken=taken, archives=archives)
        self.where = OutputPieces(plan)

    def add(self, rank: int, composed) -> None:
        plan, reshard = self.plan, self.plan.reshard
        sizes, label = tuple(reshard.layout.group_sizes()), f"rank {rank}"
        mine = composed.ranks[rank].optim_states
        out = TorchFile(self.claims, mine, label=label, whole=True)
        self.outputs.add(out.f)
        got = optimizer_state(out.obj, mine, sizes)
        if (found := flat_keys(got, mine, sizes)) != plan.keys:
            self.report.add(None, f"rank {rank}: its optimizer keeps {describe_state(found[1:])} per element, the "
                                  f"checkpoints composed {describe_state(plan.keys[1:])}")
        for g, pieces in enumerate(self.where.groups(rank)):
            for key in plan.keys:
                tensor = flat_tensor(got, g, key)
                if tensor is not None:
                    start, _n, dtype, size = out.place(tensor)
                    for p in sorted(pieces, key=lambda p: p.at):
                        self._piece(rank, out, start, dtype, size, p, key)
        self._optimizer(rank, out, got)
        self._model_states(rank, composed, label)

    def _piece(self, rank: int, out: TorchFile, start: int, dtype: str, size: int, p: Piece, key: str) -> None:
        at, n = start + p.at * size, p.length * size
        if p.source == ZEROS:
            self.joined(Tag("padding", rank, p.row, f"rank {rank}: padding after {p.param} ({key}) is not zero "
                                                    "bytes"), out.f, at, n, streamed.ZERO)
            return
        tag = Tag("frozen" if key == FROZEN else "row", rank, p.row,
                  f"rank {rank}: {key} of {p.param} (elements {p.at}…) differs from {self.names[p.source]} rank "
                  f"{p.rank}", p.source, key=key)
        files = self.plan.sources[p.source].ranks[p.rank]
        if is_dcp_rank(files) and key != FROZEN:
            self._dcp_piece(tag, out, at, dtype, size, p, key, files)
            return
        found = self._located(p, key, files)
        if found is None:  # from a source that changed since: proven by the record alone
            self.joined(tag, out.f, at, n)
            return
        f, their_at, their_dtype, their_size = found
        tag.file = f
        if (their_dtype, their_size) != (dtype, size):
            tag.kind = "row-dtype"
            tag.problem = f"rank {rank}: {key} of {p.param} is {dtype}, {self.names[p.source]}'s {their_dtype}"
            self.claim(tag, out.f, at, n)
            return
        if files.whole_records or key == FROZEN:  # (a partial save's slices lie side by side, each its own CRC-32's)
            self.joined(tag, out.f, at, n, f, their_at)
        else:
            self.claim(tag, out.f, at, n, f, their_at)

    def _located(self, p: Piece, key: str, files) -> tuple[int, int, str, int] | None:
        """(file, first byte, dtype, itemsize) of piece `p`'s elements in its source (None: changed since)."""
        s = p.source
        if key == FROZEN:
            found = self.torch_file(s, files.model_states)
            if found is None:
                return None
            fragment = (found.obj.get(FROZEN_PARAM_FRAGMENTS) or {}).get(p.param)
            if fragment is None:
                raise CheckpointError(f"{files.model_states}: has no fragment of frozen parameter {p.param}")
            start, _n, dtype, size = found.place(fragment)
            return found.f, start + p.offset * size, dtype, size
        if not files.whole_records:  # a partial save's slice of the parameter: checked whole by its CRC-32
            rows = self.slices_file(s, files.state_file)
            return None if rows is None else (rows.f, rows.slice(f"{key}/{p.param}", p.whole) + p.within * 4,
                                              "FloatStorage", 4)
        found = self.torch_file(s, files.optim_states)
        if found is None:
            return None
        tensor = flat_tensor(found.optimizer(self.plan.sources[s].layout.group_sizes()), p.group, key)
        if tensor is None:
            raise CheckpointError(f"{files.optim_states}: keeps no {key} for sub-group {p.group}")
        start, _n, dtype, size = found.place(tensor)
        return found.f, start + p.offset * size, dtype, size

    def _dcp_piece(self, tag: Tag, out: TorchFile, at: int, dtype: str, size: int, p: Piece, key: str,
                   files) -> None:
        """A piece from a DCP checkpoint: the elements [within, within + length) of the parameter, found in the
        chunks that hold them (each a range of its elements), each chunk's record checked by its CRC-32."""
        if p.source in self.changed:
            self.claim(tag, out.f, at, p.length * size)
            return
        name = f"model.{p.param}" if key == MASTERS else f"{files.optim}state.{p.param}.{key}"
        entry = files.metadata.state_dict_metadata.get(name)
        if entry is None or not hasattr(entry, "chunks"):
            raise CheckpointError(f"{files.folder}: has no tensor {name}")
        first, end = p.within, p.within + p.length
        for chunk in entry.chunks:
            begin, count = chunk_range(tuple(entry.size), tuple(chunk.offsets), tuple(chunk.sizes), files.folder, name)
            a, b = max(first, begin), min(end, begin + count)
            if a >= b:
                continue
            info = files.metadata.storage_data[MetadataIndex(name, chunk.offsets)]
            f, located = claimed_chunk(self.claims, files.folder, entry, chunk, info)
            self.file_source[f] = p.source
            part = Tag(tag.kind, tag.rank, tag.row, tag.problem, tag.source, f, tag.key)
            their_size = located.record.size // max(located.numel, 1)
            if their_size != size:
                part.kind, part.problem = "row-dtype", f"rank {tag.rank}: {key} of {p.param} is {dtype}, " \
                                                       f"{self.names[p.source]}'s {located.dtype}"
                self.claim(part, out.f, at + (a - first) * size, (b - a) * size)
                continue
            self.claim(part, out.f, at + (a - first) * size, (b - a) * size, f,
                        located.record.data_offset + (a - begin) * size)

    def _optimizer(self, rank: int, out: TorchFile, got: dict) -> None:
        """The optim file but its flat tensors: the base's rank 0's, at the new world size."""
        plan, reshard, report = self.plan, self.plan.reshard, self.report
        if got.get(PARTITION_COUNT) != reshard.world_size:
            report.add(None, f"rank {rank}: partition_count is {got.get(PARTITION_COUNT)!r}, not {reshard.world_size}")
        for i, (group, members) in enumerate(zip(got[OPTIMIZER_STATE_DICT][PARAM_GROUPS], reshard.param_groups)):
            if list(group.get("params", ())) != list(members):
                report.add(None, f"rank {rank}: param group {i} lists sub-groups {group.get('params')}, "
                                 f"DeepSpeed at world size {reshard.world_size} has {list(members)}")
        state = got[OPTIMIZER_STATE_DICT][STATE]
        if sorted(state) != list(range(len(reshard.layout.groups))):
            report.add(None, f"rank {rank}: optimizer state of sub-groups {sorted(state)}, expected "
                             f"{len(reshard.layout.groups)}")
        base = self.torch_file(0, plan.base.ranks[0].structure_file)
        if base is None:
            return
        problem = f"rank {rank}: optimizer state {{where}} is not the base's"
        claim = self.tensor_claims(out, base, "state", rank, row=None, problem=problem, s=0)
        for where in self.compared("optim", out.obj, base.obj, _replaced, claim)[:MAX_SHOWN]:
            report.add(None, problem.replace("{where}", where, 1))
        group_of = {slot.name: slot.group for slot in plan.base.layout.slots}
        base_state = base.obj[OPTIMIZER_STATE_DICT][OPTIMIZER_STATE_DICT][STATE]
        per_element = tuple(f"[{key!r}]" for key in plan.keys[1:])
        for g, params in enumerate(reshard.layout.groups):
            first = group_of[params[0][0]]
            problem = f"rank {rank}: optimizer state {{where}} is not the base's sub-group {first}'s"
            unlike = structure_differences(state.get(g), base_state.get(first), f"[{STATE!r}][{g}]",
                                           skip=lambda w: w.endswith(per_element),
                                           tensors=self.tensor_claims(out, base, "state", rank, row=None,
                                                                      problem=problem, s=0))
            for where in unlike[:2]:
                report.add(None, problem.replace("{where}", where, 1))

    def _model_states(self, rank: int, composed, label: str) -> None:
        plan, reshard, report = self.plan, self.plan.reshard, self.report
        states = TorchFile(self.claims, composed.ranks[rank].model_states, label=label, whole=True)
        self.outputs.add(states.f)
        obj = states.obj if isinstance(states.obj, dict) else {}
        if obj.get(DP_WORLD_SIZE) != reshard.world_size:
            report.add(None, f"rank {rank}: model_states dp_world_size is {obj.get(DP_WORLD_SIZE)!r}, not "
                             f"{reshard.world_size}")
        shapes = [tuple((name, tuple(shape)) for name, shape in group.items()) for group in obj.get(PARAM_SHAPES) or ()]
        if tuple(shapes) != reshard.layout.groups:
            report.add(None, f"rank {rank}: model_states param_shapes are not DeepSpeed's sub-groups at world size "
                             f"{reshard.world_size}")
        fragments = obj.get(FROZEN_PARAM_FRAGMENTS) or {}
        for name, pieces in self.where.frozen(rank):
            if name not in fragments:
                report.add(None, f"rank {rank}: model_states holds no fragment of frozen parameter {name}")
                continue
            start, _n, dtype, size = states.place(fragments[name])
            for p in pieces:
                self._piece(rank, states, start, dtype, size, p, FROZEN)
        buffers, owner = plan.buffer_sources(), plan.base.param_to_row()
        written = all(self.archives.proven(names) for names in plan.output_rank_files()) \
            if any(s in self.changed for s in buffers.values()) else False
        for name, s in buffers.items():
            theirs = self.torch_file(s, plan.sources[s].ranks[0].model_states)
            if theirs is None:
                line = f"buffer {name}: not compared: {self.names[s]} changed since the composition"
                if not written and line not in report.unproven:
                    report.unproven.append(line)
                continue
            where = f"[{MODULE!r}][{name!r}]"
            problem = f"rank {rank}: buffer {name} differs from {self.names[s]}"
            for _difference in structure_differences(
                    (obj.get(MODULE) or {}).get(name), (theirs.obj.get(MODULE) or {}).get(name), where,
                    tensors=self.tensor_claims(states, theirs, "buffer", rank, row=owner[name], problem=problem, s=s)):
                report.add(owner[name], problem)
        base = self.torch_file(0, plan.base.ranks[0].model_states)
        if base is None:
            return
        skip = {f"[{DP_WORLD_SIZE!r}]", f"[{PARAM_SHAPES!r}]", *(f"[{MODULE!r}][{b!r}]" for b in buffers)}
        problem = f"rank {rank}: model_states {{where}} is not the base's"
        for where in self.compared(
                "states", states.obj, base.obj, lambda w: w in skip or w.startswith(f"[{FROZEN_PARAM_FRAGMENTS!r}]"),
                self.tensor_claims(states, base, "states", rank, row=None, problem=problem, s=0))[:MAX_SHOWN]:
            report.add(None, problem.replace("{where}", where, 1))


def _replaced(where: str) -> bool:
    return where.startswith(REPLACED) or (
        where.startswith(f"{OUTER}{OUTER}[{PARAM_GROUPS!r}]") and where.endswith("['params']"))


def verify_resharded(plan, composed, report, emit: Emit, cancelled: Callable[[], bool], *,
                     changed: set[int] | None = None, taken: dict | None = None, archives: Archives | None = None,
                     workers: int = 2) -> None:
    """Check every output rank of a resharded `plan` into `report` (`against_recipe.VerifyReport`), alone (its
    model files not among the claims: `against_recipe.verify_against_recipe` checks everything)."""
    ranks = ReshardedRanks(plan, report, changed=set() if changed is None else changed, taken=taken,
                           archives=archives or Archives(None, plan.output, plan.base.tag))
    for rank in range(plan.world_size):
        ranks.add(rank, composed)
    ranks.check(emit, cancelled, workers)
