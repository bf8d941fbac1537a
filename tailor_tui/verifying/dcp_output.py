"""A DCP composition re-checked against its recipe and its sources (`--verify` of a recipe whose base is a
PyTorch Distributed Checkpoint), none of the writer's code used. `.metadata` is read by the one allow-listed
reader (`dcp.reading`; torch's own `FileSystemReader` unpickles anything, never to be pointed at a file
another user could have written).

The output must list every key its base lists, and no other; each key's entry (dtype, size, chunks) is that
of the checkpoint its row was picked from (the param groups and every `step`: the base's, as the plan says);
and each of its archives, where the output's metadata places it, holds byte for byte the archive the
source's metadata places for the same chunk: compared in 1 MiB reads, whatever the sizes. Each of the base's
run-level files (the HF Trainer's, beside its DCP folders) is in the output byte for byte.
"""

from __future__ import annotations

import os
from pathlib import Path

from tailor_tui.checkpoints.dcp_checkpoint import DcpCheckpoint, read_parts
from tailor_tui.dcp.metadata import MetadataIndex
from tailor_tui.errors import CheckpointError, TailorError
from tailor_tui.verifying.against_recipe import VerifyReport
from tailor_tui.verifying.compare import same_bytes
from tailor_tui.verifying.dcp_sources import DcpFiles, DcpTensors, ZeroTensors

CHUNK = 1 << 20


def verify_dcp(plan) -> VerifyReport:
    """`plan` (a `planning.dcp_plan.DcpComposePlan`): its output compared with its sources."""
    report = VerifyReport()
    rows = plan.base.row_of_key()
    try:
        out = read_parts(plan.output, plan.base.parts)
    except TailorError as exc:
        report.other.append(f"{exc}; is this the output of this recipe?")
        return report
    sources = [s.metadata if isinstance(s, DcpCheckpoint) else None for s in plan.sources]
    wanted, got = set(plan.base.metadata.state_dict_metadata), set(out.state_dict_metadata)
    for key in sorted(wanted - got):
        _said(report, rows, key, f"{key}: missing from the output")
    for key in sorted(got - wanted):
        report.other.append(f"{key}: in the output, not in the base {plan.base.path}")
    zero, written = ZeroTensors(), DcpTensors()
    output = DcpFiles(plan.output, out, plan.base.optim)
    aliases = {alias: target for row in plan.base.rows for alias, target in row.aliases}
    for key in sorted(wanted & got):
        s = plan.taken[key]
        if not isinstance(plan.sources[s], DcpCheckpoint):  # a ZeRO-3 checkpoint's row: its values, element for element
            problem = _same_values(output, plan.sources[s], key, aliases, plan.base.optim, zero, written)
            _said(report, rows, key, problem)
            continue
        source, path = sources[s], plan.sources[s].path
        mine, theirs = out.state_dict_metadata[key], source.state_dict_metadata[plan.source_key(key)]
        if _entry(mine) != _entry(theirs):
            _said(report, rows, key, f"{key}: its entry is not {plan.sources[s].name}'s ({_entry(mine)[:2]} vs "
                                     f"{_entry(theirs)[:2]})")
            continue
        offsets = [c.offsets for c in theirs.chunks] if hasattr(theirs, "chunks") else [None]
        for at in offsets:
            index = MetadataIndex(key, at)
            placed, info = out.storage_data.get(index), source.storage_data[MetadataIndex(plan.source_key(key), at)]
            if placed is None:
                _said(report, rows, key, f"{key}: the output places no bytes for its chunk at {list(at or ())}")
                continue
            problem = _same_bytes(plan.output / placed.relative_path, placed.offset, placed.length,
                                  path / info.relative_path, info.offset, info.length)
            if problem:
                _said(report, rows, key, f"{key} (chunk at {list(at or ())}): {problem} {plan.sources[s].name}'s")
    for name in plan.copied:
        length = _size(plan.output / name)
        problem = "missing, not" if length < 0 else _same_bytes(plan.output / name, 0, length, plan.base.path / name, 0,
                                                                  _size(plan.base.path / name))
        if problem:
            report.other.append(f"{name}: {problem} the base's (a run-level file, copied from the base)")
    return report


def _size(path: Path) -> int:
    try:
        return os.lstat(path).st_size
    except OSError:
        return -1


def _same_values(output: DcpFiles, ckpt, key: str, aliases: dict[str, str], optim: str, zero: ZeroTensors,
                 written: DcpTensors) -> str | None:
    """None where the output's tensor `key` holds the ZeRO-3 checkpoint `ckpt`'s values of it bit for bit (its fp32
    masters, or a state kept per element); else what differs."""
    if key.startswith("model."):
        param, flat = aliases.get(key[len("model."):], key[len("model."):]), "fp32"
    else:
        param, _, flat = key[len(optim) + len("state."):].rpartition(".")
    try:
        mine, theirs = written.tensor(output, key), zero.flat(ckpt, flat, param)
    except CheckpointError as exc:
        return f"{key}: {exc}"
    if mine.dtype != theirs.dtype or mine.shape != theirs.shape or not same_bytes(mine, theirs):
        return f"{key}: its values are not {ckpt.name}'s {flat} of {param}"
    return None


def _entry(entry) -> tuple:
    if not hasattr(entry, "size"):
        return ("bytes",)
    return (entry.size, entry.dtype, sorted((c.offsets, c.sizes) for c in entry.chunks))


def _said(report: VerifyReport, rows: dict[str, str], key: str, problem: str | None) -> None:
    if problem is None:
        return
    row = rows.get(key)
    if row is not None:
        report.problems[row].append(problem)
    else:
        report.other.append(problem)


def _same_bytes(out: Path, at: int, length: int, src: Path, src_at: int, src_length: int) -> str | None:
    """None where `length` bytes at `at` of `out` are those at `src_at` of `src`; else what differs."""
    if length != src_length:
        return f"{length:,} bytes where the source's archive has {src_length:,}, not"
    try:
        a, b = os.open(out, os.O_RDONLY | os.O_NOFOLLOW), os.open(src, os.O_RDONLY)
    except OSError as exc:
        return f"cannot be read ({exc.strerror or exc}), so not proven"
    try:
        done = 0
        while done < length:
            n = min(CHUNK, length - done)
            x, y = os.pread(a, n, at + done), os.pread(b, n, src_at + done)
            if len(x) < n:
                return "the output file ends before its bytes do: not"
            if x != y:
                first = next(i for i in range(len(x)) if i >= len(y) or x[i] != y[i])
                return f"differs at byte {done + first:,} of its archive from"
            done += n
        return None
    finally:
        os.close(a)
        os.close(b)
