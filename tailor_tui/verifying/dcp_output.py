"""A DCP composition re-checked against its recipe and its sources (`--verify` of a recipe whose base is a
PyTorch Distributed Checkpoint), none of the writer's code used. `.metadata` is read by the one allow-listed
reader (`dcp.reading`; torch's own `FileSystemReader` unpickles anything, never to be pointed at a file
another user could have written).

The output must list every key its base lists, and no other; each key's entry (dtype, size, chunks) is that
of the checkpoint its row was picked from (the param groups and every `step`: the base's, as the plan says).
Each chunk's archive, where the output's metadata places it, holds the records of the archive the source's
metadata places for the same chunk, record for record, byte for byte; a row taken from a ZeRO-3 checkpoint
holds, in each chunk (a range of the parameter's elements), those elements of the ranks that hold them, in
their sub-group's flat tensor (or a partial save's slice). Each of the base's run-level files (the HF
Trainer's, beside its DCP folders) is in the output byte for byte. Every comparison is a claim on the output's
bytes, run streamed (`streamed`): each file read once, every record checked against its CRC-32 as it is read.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from tailor_tui.checked.evidence import record_failed
from tailor_tui.checked.files import open_regular
from tailor_tui.checkpoints.dcp_checkpoint import DcpCheckpoint, read_parts
from tailor_tui.dcp.metadata import MetadataIndex
from tailor_tui.dcp.reading import archive_records
from tailor_tui.errors import CheckpointError, TailorError
from tailor_tui.events import ByteCounter, Emit
from tailor_tui.formats.ds_format import flat_tensor
from tailor_tui.verifying import streamed
from tailor_tui.verifying.against_recipe import VerifyReport
from tailor_tui.verifying.dcp_sources import chunk_range, claimed_chunk
from tailor_tui.verifying.rank_claims import SlicesFile, TorchFile


@dataclass(frozen=True)
class _Said:
    """What a claim stands for: the key it is of ("": none) and what is told where its bytes differ (of the first
    output byte found differing)."""

    key: str
    problem: Callable[[int], str]


class _DcpOutput:
    def __init__(self, plan, report: VerifyReport):
        self.plan, self.report = plan, report
        self.claims = streamed.Comparison()
        self.said: list[_Said] = []
        self.rows = plan.base.row_of_key()
        self.evidenced: set[tuple[Path, str]] = set()
        self.structures: dict[Path, TorchFile | SlicesFile] = {}  # ZeRO-3 sources' files, read once
        self.outputs: set[int] = set()

    def problem(self, key: str | None, problem: str | None) -> None:
        if problem is None:
            return
        row = self.rows.get(key) if key is not None else None
        if row is not None:
            self.report.problems[row].append(problem)
        else:
            self.report.other.append(problem)

    def claim(self, key: str, problem: str | Callable[[int], str], out: int, at: int, n: int, source: int,
              source_at: int) -> None:
        self.claims.claim(out, at, n, source, source_at, len(self.said))
        self.said.append(_Said(key, problem if callable(problem) else _told(problem)))

    def records(self, folder: Path, info, what: str, *, label: str | None = None) -> tuple[int, dict]:
        """(file index, records) of the archive `info` places in `folder`, each record's CRC-32 evidence."""
        path = folder / info.relative_path
        fd = open_regular(path)
        try:
            found = archive_records(folder, fd, info, what)
        finally:
            os.close(fd)
        f = self.claims.file(path, label=label)
        for record in found.values():
            self.claims.evidence(f, record.data_offset, record.size, record.crc, record.name)
        return f, found

    def chunks_from_dcp(self, key: str, out_meta, source, s: int) -> None:
        """Key `key` from a DCP source: each chunk's archive, record for record, the source's."""
        plan = self.plan
        mine, theirs = out_meta.state_dict_metadata[key], source.metadata.state_dict_metadata[plan.source_key(key)]
        if _entry(mine) != _entry(theirs):
            self.problem(key, f"{key}: its entry is not {source.name}'s ({_entry(mine)[:2]} vs {_entry(theirs)[:2]})")
            return
        for at in [c.offsets for c in theirs.chunks] if hasattr(theirs, "chunks") else [None]:
            placed = out_meta.storage_data.get(MetadataIndex(key, at))
            info = source.metadata.storage_data[MetadataIndex(plan.source_key(key), at)]
            where = f"{key} (chunk at {list(at or ())})"
            if placed is None:
                self.problem(key, f"{key}: the output places no bytes for its chunk at {list(at or ())}")
                continue
            f, out_records = self.records(plan.output, placed, f"the archive of {where}",
                                          label=placed.relative_path)
            self.outputs.add(f)
            g, src_records = self.records(source.path, info, f"the archive of {where}")
            if sorted(out_records) != sorted(src_records):
                self.problem(key, f"{where}: its archive holds records {sorted(out_records)}, not "
                                  f"{source.name}'s {sorted(src_records)}")
                continue
            for name, record in out_records.items():
                theirs_record = src_records[name]
                problem = f"{where}: its record {name} differs from {source.name}'s"
                if record.size != theirs_record.size:
                    self.problem(key, problem)
                elif record.size:
                    self.claim(key, problem, f, record.data_offset, record.size, g, theirs_record.data_offset)

    def chunks_from_zero(self, key: str, out_meta, ckpt, s: int, aliases: dict[str, str]) -> None:
        """Key `key` from a ZeRO-3 checkpoint: each chunk (a range of the parameter's elements) holds those
        elements as the source's ranks hold them, in their sub-group's flat tensor or a partial save's slice."""
        plan, optim = self.plan, self.plan.base.optim
        if key.startswith("model."):
            param, flat = aliases.get(key[len("model."):], key[len("model."):]), "fp32"
        else:
            param, _, flat = key[len(optim) + len("state."):].rpartition(".")
        problem = f"{key}: its values are not {ckpt.name}'s {flat} of {param}"
        entry = out_meta.state_dict_metadata[key]
        slot = next((slot for slot in ckpt.layout.slots if slot.name == param), None)
        if slot is None or not hasattr(entry, "chunks") or tuple(entry.size) and slot.numel != _numel(entry.size):
            self.problem(key, problem)
            return
        for chunk in entry.chunks:
            info = out_meta.storage_data.get(MetadataIndex(key, chunk.offsets))
            if info is None:
                self.problem(key, f"{key}: the output places no bytes for its chunk at {list(chunk.offsets)}")
                continue
            f, located = claimed_chunk(self.claims, plan.output, entry, chunk, info, label=info.relative_path)
            self.outputs.add(f)
            size = located.record.size // max(located.numel, 1)
            begin, count = chunk_range(tuple(entry.size), tuple(chunk.offsets), tuple(chunk.sizes), plan.output, key)
            if size != 4:  # a ZeRO-3 checkpoint keeps fp32 masters and states
                self.problem(key, problem)
                continue
            for rank, files in enumerate(ckpt.ranks):
                first, valid = rank * slot.part, slot.valid(rank)
                a, b = max(begin, first), min(begin + count, first + valid)
                if a >= b:
                    continue
                g, their_at = self.zero_place(files, ckpt, slot, flat, valid)
                self.claim(key, problem, f, located.record.data_offset + (a - begin) * 4, (b - a) * 4, g,
                           their_at + (a - first) * 4)

    def zero_place(self, files, ckpt, slot, flat: str, valid: int) -> tuple[int, int]:
        """(file, first byte) of a ZeRO-3 rank's elements of `slot` in its flat tensor `flat` (fp32), evidenced: a
        partial save's slice by its recorded CRC-32, a full save's by its record's (each file's structure read once)."""
        path = files.optim_states if files.whole_records else files.state_file
        if path not in self.structures:
            self.structures[path] = (TorchFile if files.whole_records else SlicesFile)(self.claims, path)
        found = self.structures[path]
        if isinstance(found, SlicesFile):
            return found.f, found.slice(f"{flat}/{slot.name}", valid)
        tensor = flat_tensor(found.optimizer(ckpt.layout.group_sizes()), slot.group, flat)
        if tensor is None:
            raise CheckpointError(f"{path}: keeps no {flat} for sub-group {slot.group}")
        start, _n, _dtype, size = found.place(tensor)
        if size != 4:
            raise CheckpointError(f"{path}: its {flat} of sub-group {slot.group} is not fp32")
        return found.f, start + slot.offset * 4

    def copied(self, name: str) -> None:
        out, base = self.plan.output / name, self.plan.base.path / name
        if not out.is_file():
            self.report.other.append(f"{name}: missing, not the base's (a run-level file, copied from the base)")
            return
        f, g = self.claims.file(out, label=name), self.claims.file(base)
        self.outputs.add(f)
        if self.claims.size(f) != self.claims.size(g):
            self.report.other.append(f"{name}: {self.claims.size(f):,} bytes where the base's has "
                                     f"{self.claims.size(g):,}, not the base's (a run-level file, copied from the "
                                     "base)")
            return
        self.claims.evidence(f, 0, self.claims.size(f), None, name)
        self.claims.evidence(g, 0, self.claims.size(g), None, name)
        if self.claims.size(f):
            self.claim("", lambda at: f"{name}: differs at byte {at:,} from the base's (a run-level file, copied "
                               "from the base)", f, 0, self.claims.size(f), g, 0)

    def run(self, emit: Emit, cancelled: Callable[[], bool], workers: int) -> None:
        claims = self.claims
        counter = ByteCounter("output", sum(claims.size(f) for f in self.outputs), emit, cancelled)
        outcome = streamed.run(claims, workers=workers, on_bytes=lambda label, n: counter.add(n) if label != "sources"
                               else None, cancelled=cancelled)
        counter.finish()
        if outcome.moved:
            raise streamed.moved_error(outcome.moved[0])
        for stretch, value in outcome.failed:
            path = claims.paths[stretch.file]
            if stretch.file in self.outputs:
                self.report.other.append(streamed.damaged_output(path, stretch, value))
            else:
                raise record_failed(path, stretch, value)
        told = set()
        for i in sorted(outcome.differing):
            said = self.said[i]
            problem = said.problem(outcome.first.get(i, 0))
            if (said.key, problem) not in told:
                told.add((said.key, problem))
                self.problem(said.key or None, problem)


def verify_dcp(plan, emit: Emit = lambda e: None, cancelled: Callable[[], bool] = lambda: False, *,
               workers: int = 2) -> VerifyReport:
    """`plan` (a `planning.dcp_plan.DcpComposePlan`): its output compared with its sources."""
    report = VerifyReport()
    try:
        out = read_parts(plan.output, plan.base.parts)
    except TailorError as exc:
        report.other.append(f"{exc}; is this the output of this recipe?")
        return report
    check = _DcpOutput(plan, report)
    wanted, got = set(plan.base.metadata.state_dict_metadata), set(out.state_dict_metadata)
    for key in sorted(wanted - got):
        check.problem(key, f"{key}: missing from the output")
    for key in sorted(got - wanted):
        report.other.append(f"{key}: in the output, not in the base {plan.base.path}")
    aliases = {alias: target for row in plan.base.rows for alias, target in row.aliases}
    for key in sorted(wanted & got):
        s = plan.taken[key]
        source = plan.sources[s]
        if isinstance(source, DcpCheckpoint):
            check.chunks_from_dcp(key, out, source, s)
        else:  # a ZeRO-3 checkpoint's row: its elements, rank by rank
            check.chunks_from_zero(key, out, source, s, aliases)
    for name in plan.copied:
        check.copied(name)
    check.run(emit, cancelled, workers)
    return report


def _told(problem: str) -> Callable[[int], str]:
    return lambda _at: problem


def _numel(size) -> int:
    n = 1
    for d in size:
        n *= d
    return n


def _entry(entry) -> tuple:
    if not hasattr(entry, "size"):
        return ("bytes",)
    return (entry.size, entry.dtype, sorted((c.offsets, c.sizes) for c in entry.chunks))
