"""Re-check a finished output against its recipe and sources, row by row, byte for byte.

Every comparison is of bytes, not values: -0.0 is not 0.0, a NaN equals the same NaN
(so a row that holds NaNs verifies when it was copied exactly). For every rank, each
row's fp32 master weights, exp_avg and exp_avg_sq in the output equal its chosen
source's and padding is zero bytes; everything else in the optimizer state (param
groups, loss scaler, sub-group steps, counters) and in model_states equals the base's,
but frozen fragments and buffers, which follow their row; the weight files have the
header tailor-tui writes and each tensor of the chosen source (`weights`); every other
file equals the base's. Every record of every torch file read, the output's and the
sources', is checked against its stored CRC-32 on the way (`torch_files`), every slice of a
partial checkpoint against the CRC-32 its save recorded (`rows_files`). Sources are only read
(memory-mapped), never modified.

What the output must hold is worked out here from the plan's picks and each checkpoint's
layout, read with the formats' reference readers (torch, safetensors): none of the writers'
code or readers is used, so a bug there is caught here, not repeated.
"""

from __future__ import annotations

import ast
import filecmp
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from tailor_tui.checkpoints.checkpoint import (
    ARCHIVES,
    COPIED,
    MODEL_FILE_INDEX,
    PROVENANCE,
    TAKEN,
    TAKEN_WEIGHTS,
    WEIGHT_HEADERS,
    open_checkpoint,
    read_latest,
)
from tailor_tui.checkpoints.side_files import MAX_RECORD, read_small
from tailor_tui.errors import CheckpointError
from tailor_tui.events import ByteCounter, Emit
from tailor_tui.formats.ds_format import (
    FP32_FLAT_GROUPS,
    FROZEN_PARAM_FRAGMENTS,
    OPTIMIZER_STATE_DICT,
    STATE,
    bytes_per_element,
    describe_state,
    flat_keys,
    flat_tensor,
    optimizer_state,
)
from tailor_tui.planning.plan import ComposePlan
from tailor_tui.planning.provenance import changed_since, read_record
from tailor_tui.verifying.compare import differences, nonzero_bytes, same_bytes
from tailor_tui.verifying.recorded import (
    FROZEN,
    Archives,
    RankRows,
    file_crc,
    recorded,
    recorded_crcs,
    recorded_weights,
    settle,
)
from tailor_tui.verifying.rows_files import RowsFiles
from tailor_tui.verifying.torch_files import is_zip, load, torch_reads
from tailor_tui.verifying.weights import WeightRecord, verify_weight_file


@dataclass
class VerifyReport:
    problems: dict[str, list[str]] = field(default_factory=lambda: defaultdict(list))  # row -> problems
    other: list[str] = field(default_factory=list)  # problems not tied to a row
    # sources that changed since the composition (its provenance record tells them), a line each: the
    # output's rows are proven against the CRC-32s of what was taken instead (`taken`)
    changed: list[str] = field(default_factory=list)
    unproven: list[str] = field(default_factory=list)  # what was not compared, as it comes from those
    by_record: set[str] = field(default_factory=set)  # rows proven against the record alone (on some rank)

    @property
    def ok(self) -> bool:
        return not self.other and not any(self.problems.values()) and not self.changed and not self.unproven

    @property
    def output_ok(self) -> bool:
        """Nothing found wrong with the output (its sources may have changed since: `changed`)."""
        return not self.other and not any(self.problems.values())

    def add(self, row: str | None, problem: str) -> None:
        (self.other if row is None else self.problems[row]).append(problem)

    def changed_in_place(self, line: str) -> None:
        if line not in self.changed:
            self.changed.append(line)


def verify_against_recipe(plan: ComposePlan, emit: Emit = lambda e: None,
                          cancelled: Callable[[], bool] = lambda: False) -> VerifyReport:
    report = VerifyReport()
    out = plan.output
    if not (out / plan.base.tag).is_dir():
        report.add(None, f"{out}: no tag folder {plan.base.tag}; is this the output of this recipe?")
        return report
    record = read_record(out)  # (none readable: said apart, below)
    taken = recorded(record, TAKEN)
    changed = _sources_changed(plan, record)
    if changed and taken is None:  # an older record: nothing to prove the output against but its sources
        for lines in changed.values():
            for line in lines:
                report.add(None, f"{line}: the output is not compared with what it holds now; compose again from "
                                 "the checkpoints as they are, or verify before they change")
        return report
    report.changed.extend(line for lines in changed.values() for line in lines)
    try:
        composed = open_checkpoint(out)
    except CheckpointError as exc:
        report.add(None, str(exc))
        return report
    expected = plan.reshard.layout if plan.reshard else plan.base.layout
    diff = expected.describe_difference(composed.layout)
    if diff:
        what = f"DeepSpeed's at world size {plan.world_size}" if plan.reshard else "the base's"
        report.add(None, f"{out}: its layout is not {what}: it has {diff}")
        return report
    composed.check_complete()  # a rank file that is no whole archive (or no regular file): exit 4, before torch
    gone = set(changed)  # and those found changed on the way: files that fail the checks the composition passed
    archives = Archives(recorded_crcs(record, ARCHIVES), out, plan.base.tag)  # (asked only once one changed)
    if plan.reshard is not None:
        from tailor_tui.verifying.resharded import verify_resharded

        verify_resharded(plan, composed, report, emit, cancelled, changed=gone, taken=taken, archives=archives)
    else:
        param_row = plan.base.param_to_row()
        for rank in range(plan.base.world_size):
            _verify_rank(plan, rank, composed, param_row, report, emit, cancelled, gone, taken, archives)
    partial = RowsFiles()
    weights, headers = recorded_weights(record, TAKEN_WEIGHTS), recorded_crcs(record, WEIGHT_HEADERS)
    for job in plan.model_file_jobs():
        verify_weight_file(plan, job, report, partial, changed=frozenset(gone), record=WeightRecord(
            None if weights is None else weights.get(job.name), None if headers is None else headers.get(job.name),
            archives))
    for line in archives.failed:
        report.add(None, line)
    own = plan.own_files()
    if MODEL_FILE_INDEX in own:
        index = out / MODEL_FILE_INDEX
        try:
            written = read_small(index, MAX_RECORD, follow=False).decode(errors="replace")
        except (OSError, ValueError):
            written = None
        if written != own[MODEL_FILE_INDEX]:
            report.add(None, f"{index}: missing or not the index the model files' layout records")
    root, copied = plan.other_files_root(), recorded_crcs(record, COPIED)
    for rel, to in plan.other_files():
        if 0 in gone and (out / to).is_file():  # what was copied, as recorded
            if copied is None or str(to) not in copied:
                report.unproven.append(f"{out / to}: not compared: the base's {rel} may have changed since the "
                                       "composition, and the output's provenance record holds no CRC-32 of it")
            elif file_crc(out / to) != copied[str(to)]:
                report.add(None, f"{out / to}: differs from what the composition copied from the base's {rel} (its "
                                 "provenance record)")
            continue
        if not (out / to).is_file():
            report.add(None, f"{out / to}: missing (the base has {rel})")
        elif not filecmp.cmp(root / rel, out / to, shallow=False):
            report.add(None, f"{out / to}: differs from the base's {root / rel}")
        elif is_zip(out / to) and (why := torch_reads(out / to)) is not None:  # its bytes match: torch reads it?
            report.add(None, f"{out / to}: torch's reader cannot read it ({why}), nor the base's {root / rel}")
    if "latest" in own and read_latest(out) != own["latest"]:
        report.add(None, f"{out / 'latest'}: names {read_latest(out)!r}, not the tag {plan.base.tag!r} composed; "
                         "DeepSpeed would load another checkpoint")  # (an HF base's `latest` is among its files)
    if not (out / PROVENANCE).is_file():
        report.add(None, f"{out / PROVENANCE}: missing; the output was not written by tailor-tui")
    for extra in _unplanned(plan, out):
        report.add(None, f"{out / extra}: not a file this composition writes (neither composed nor copied "
                         "from the base); it was added to the output afterwards")
    return report


def _sources_changed(plan: ComposePlan, record: dict | None) -> dict[int, list[str]]:
    """{the plan's index of a source: a line per file of it} of the sources `record` names that changed
    since the composition read them (`provenance.changed_since`); -1 for one the plan does not name."""
    if record is None:
        return {}
    index = {str(src.path.resolve()): s for s, src in enumerate(plan.sources)}
    found: dict[int, list[str]] = {}
    for path, line in changed_since(record):
        found.setdefault(index.get(path, -1), []).append(line)
    return found


def _unplanned(plan: ComposePlan, out: Path) -> list[Path]:
    """Files in the output that the plan accounts for neither as composed nor as copied."""
    expected = {Path(plan.base.tag) / name for names in plan.output_rank_files() for name in names}
    expected |= {Path(job.name) for job in plan.model_file_jobs()}
    expected |= {to for _rel, to in plan.other_files()}
    expected |= {Path("latest"), Path(MODEL_FILE_INDEX), Path(PROVENANCE)}
    return sorted(p.relative_to(out) for p in out.rglob("*")
                  if (p.is_file() or p.is_symlink()) and p.relative_to(out) not in expected)


def _verify_rank(plan, rank, composed, param_row, report, emit, cancelled, changed: set[int], taken,
                 archives: Archives) -> None:
    """Rank `rank` of an output at the base's world size: every slot of the base's layout holds,
    in the output, its source's elements at the same place (every checkpoint of the recipe has the
    base's layout), then padding of zero bytes. A source that changed since the composition
    (`changed`) is not read: the rows it gave are proven against what the composition recorded it
    took (`taken`, `verifying.recorded`), as every row is where the record holds it, and the rest of its files
    against the records the composition wrote (`archives`)."""
    source_of = plan.source_of_param()
    written = plan.output_rank_files()[rank]
    used = {0} | {source_of[slot.name] for slot in plan.base.layout.slots}
    files = {s: plan.sources[s].ranks[rank] for s in sorted(used)}
    sizes = tuple(plan.base.layout.group_sizes())
    counter = ByteCounter(f"rank {rank}", plan.base.rank_bytes(rank), emit, cancelled)
    mine = composed.ranks[rank].optim_states
    got_file = load(mine)
    got = optimizer_state(got_file, mine, sizes)
    if (found := flat_keys(got, mine, sizes)) != plan.keys:
        report.add(None, f"rank {rank}: its optimizer keeps {describe_state(found[1:])} per element, the "
                         f"checkpoints composed {describe_state(plan.keys[1:])}")
    loaded = {}
    for s, f in files.items():
        if f.whole_records and s not in changed:
            try:
                loaded[s] = load(f.optim_states)
            except CheckpointError as exc:  # the composition read it whole and checked: it changed since
                if taken is None:
                    raise
                report.changed_in_place(f"{exc} (the composition read it whole and checked it)")
                changed.add(s)
    wanted = {s: optimizer_state(obj, files[s].optim_states, sizes) for s, obj in loaded.items()}
    partial = RowsFiles()
    rows = RankRows()

    def source_slice(s: int, slot, key: str, valid: int):
        if not files[s].whole_records:  # a partial checkpoint stores each parameter's slice by name
            return partial.slice(files[s].state_file, f"{key}/{slot.name}", valid)
        return flat_tensor(wanted[s], slot.group, key)[slot.offset: slot.offset + valid]

    for slot in sorted(plan.base.layout.slots, key=lambda slot: (slot.group, slot.offset)):
        s = source_of[slot.name]
        valid = slot.valid(rank)
        row = param_row[slot.name]
        for key in plan.keys:
            out_t = flat_tensor(got, slot.group, key)
            if out_t is None:
                continue  # (a state the output lacks: said above)
            if valid:
                rows.crcs.add(row, key, out_t[slot.offset: slot.offset + valid])
                try:
                    theirs = None if s in changed else source_slice(s, slot, key, valid)
                except CheckpointError as exc:  # a partial's slice the composition read and checked: changed
                    if taken is None:
                        raise
                    report.changed_in_place(f"{exc} (the composition read it and checked it)")
                    changed.add(s)
                    theirs = None
                if theirs is None:
                    rows.from_changed[row] = s
                elif not same_bytes(out_t[slot.offset: slot.offset + valid], theirs):
                    rows.differs(row, f"rank {rank}: {key} of {slot.name} differs from {plan.sources[s].name}", s)
            if valid < slot.part and nonzero_bytes(out_t[slot.offset + valid: slot.offset + slot.part]):
                report.add(row, f"rank {rank}: padding after {slot.name} ({key}) is not zero bytes")
        counter.add(valid * bytes_per_element(plan.keys))
    outer = f"[{OPTIMIZER_STATE_DICT!r}]"
    per_element = tuple(f"[{key!r}]" for key in plan.keys[1:])

    def flat(where: str) -> bool:
        return where.startswith(f"{outer}[{FP32_FLAT_GROUPS!r}]") or (
            where.startswith(f"{outer}{outer}[{STATE!r}]") and where.endswith(per_element))

    # Everything but the flat tensors is the base's: param groups, loss scaler, steps, counters.
    if 0 in changed:
        if not archives.proven(written):
            line = ("every rank's optimizer state but the rows' tensors, and its model_states but what follows a "
                    "row: not compared, the base changed since the composition")
            report.unproven += [line] if line not in report.unproven else []
    else:
        base_file = loaded[0] if 0 in loaded else load(files[0].structure_file)
        for where in differences(got_file, base_file, skip=flat)[:5]:
            report.add(None, f"rank {rank}: optimizer state {where} is not the base's")
    _verify_model_states(plan, rank, composed, source_of, param_row, report, rows, changed,
                         lambda: archives.proven(written))
    settle(report, rank, rows, taken, [src.name for src in plan.sources])
    counter.finish()


def _verify_model_states(plan, rank, composed, source_of, param_row, report, rows: RankRows, changed,
                         proven: Callable[[], bool]) -> None:
    """model_states: the base's, but frozen fragments and buffers, each from its row's source (from a source
    that changed since the composition: proven where the rank's files hold the records written, `proven`)."""
    states = load(composed.ranks[rank].model_states)
    fragments = states.get(FROZEN_PARAM_FRAGMENTS) or {}
    for name, _shape in plan.base.layout.frozen:  # what the record holds of them
        if name in fragments:
            rows.crcs.add(param_row[name], FROZEN, fragments[name])
    loaded = {}

    def source(s: int) -> dict:
        if s not in loaded:
            loaded[s] = load(plan.sources[s].ranks[rank].model_states)
        return loaded[s]

    followed = {}  # path in model_states -> (source, row) for what follows its row
    for name, _shape in plan.base.layout.frozen:
        followed[f"[{FROZEN_PARAM_FRAGMENTS!r}][{name!r}]"] = (source_of[name], param_row[name])
    for row in plan.base.rows:
        for buffer in row.buffers:
            followed[f"['module'][{buffer!r}]"] = (source_of[buffer], row.name)
    for where, (s, row) in followed.items():
        if s in changed:
            if where.startswith(f"[{FROZEN_PARAM_FRAGMENTS!r}]"):
                rows.from_changed[row] = s  # proven by the record
            elif not proven():
                report.unproven.append(f"rank {rank}: model_states {where} ({row}) not compared: "
                                       f"{plan.sources[s].name} changed since the composition")
            continue
        for difference in differences(_at(states, where), _at(source(s), where), where):
            problem = f"rank {rank}: model_states {difference} differs from {plan.sources[s].name}"
            if where.startswith(f"[{FROZEN_PARAM_FRAGMENTS!r}]"):
                rows.differs(row, problem, s)
            else:
                report.add(row, problem)
    if 0 not in changed:
        for where in differences(states, source(0), skip=lambda w: w in followed)[:5]:
            report.add(None, f"rank {rank}: model_states {where} is not the base's")


def _at(states: dict, where: str):
    """The value at a path such as ['module']['model.x'] (None if absent)."""
    value: object = states
    for key in where[1:-1].split("]["):
        value = (value or {}).get(ast.literal_eval(key)) if isinstance(value, dict) else None
    return value
