"""Re-check a finished output against its recipe and sources, row by row.

For every rank, each row's fp32 master weights, exp_avg and exp_avg_sq in the output
must equal its chosen source's, padding must be zero, and the per-group optimizer
`step` the base's; frozen fragments and buffers follow their row; the 16-bit model
files hold each tensor of the chosen source; every other file equals the base's.
Sources are only read (memory-mapped), never modified.
"""

from __future__ import annotations

import filecmp
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from .checkpoint import MODEL_FILE_INDEX, open_checkpoint
from .errors import CheckpointError
from .events import ByteCounter, Emit
from .merge import TENSORS, _optimizer_state, _tensor
from .output import PROVENANCE
from .plan import MergePlan
from .rows import row_of
from .safe_load import load_pt


@dataclass
class VerifyReport:
    problems: dict[str, list[str]] = field(default_factory=lambda: defaultdict(list))  # row -> problems
    other: list[str] = field(default_factory=list)  # problems not tied to a row

    @property
    def ok(self) -> bool:
        return not self.other and not any(self.problems.values())

    def add(self, row: str | None, problem: str) -> None:
        (self.other if row is None else self.problems[row]).append(problem)


def verify_against_recipe(plan: MergePlan, emit: Emit = lambda e: None,
                  cancelled: Callable[[], bool] = lambda: False) -> VerifyReport:
    report = VerifyReport()
    out = plan.output
    if not (out / plan.base.tag).is_dir():
        report.add(None, f"{out}: no tag folder {plan.base.tag}; is this the output of this recipe?")
        return report
    try:
        composed = open_checkpoint(out)
    except CheckpointError as exc:
        report.add(None, str(exc))
        return report
    diff = plan.base.layout.describe_difference(composed.layout)
    if diff:
        report.add(None, f"{out}: its layout differs from the base: it has {diff}")
        return report
    param_row = plan.base.param_to_row()
    for job in plan.rank_jobs():
        _verify_rank(plan, job.rank, composed, param_row, report, emit, cancelled)
    for job in plan.model_file_jobs():
        _verify_model_file(plan, job, report)
    layout = plan.model_layout()
    if plan.base.partial and layout is not None and layout.index is not None:
        index = out / MODEL_FILE_INDEX
        if not index.is_file() or index.read_text() != layout.index:
            report.add(None, f"{index}: missing or not the index the model files' layout records")
    root = plan.other_files_root()
    for rel in plan.other_files():
        if not (out / rel).is_file():
            report.add(None, f"{out / rel}: missing (the base has it)")
        elif not filecmp.cmp(root / rel, out / rel, shallow=False):
            report.add(None, f"{out / rel}: differs from the base's {root / rel}")
    if not (out / PROVENANCE).is_file():
        report.add(None, f"{out / PROVENANCE}: missing; the output was not written by tailor-tui")
    return report


def _verify_rank(plan, rank, composed, param_row, report, emit, cancelled) -> None:
    import torch
    from safetensors import safe_open

    files = {i: src.ranks[rank] for i, src in enumerate(plan.sources)}
    sizes = tuple(plan.base.layout.group_sizes())
    counter = ByteCounter(f"rank {rank}", plan.base.rank_bytes(rank), emit, cancelled)
    mine = composed.ranks[rank].optim_states
    got = _optimizer_state(load_pt(mine), mine, sizes)
    wanted = {i: _optimizer_state(load_pt(f.optim_states), f.optim_states, sizes)
              for i, f in files.items() if f.rows is None}
    partial = {i: safe_open(str(f.rows), "pt") for i, f in files.items() if f.rows is not None}

    def source_slice(s: int, slot, key: str, valid: int):
        if s in partial:  # a partial checkpoint stores each parameter's slice by name
            return partial[s].get_slice(f"{key}/{slot.name}")[:valid]
        return _tensor(wanted[s], slot.group, key)[slot.offset: slot.offset + valid]

    source_of = plan.source_of_param()
    for slot in plan.base.layout.slots:
        s = source_of[slot.name]
        valid = slot.valid(rank)
        row = param_row[slot.name]
        for key in TENSORS:
            out_t = _tensor(got, slot.group, key)
            if valid and not torch.equal(out_t[slot.offset: slot.offset + valid], source_slice(s, slot, key, valid)):
                report.add(row, f"rank {rank}: {key} of {slot.name} differs from {plan.sources[s].name}")
            if valid < slot.part and out_t[slot.offset + valid: slot.offset + slot.part].any():
                report.add(row, f"rank {rank}: padding after {slot.name} ({key}) is not zero")
        counter.add(valid * 12)
    base_state = (wanted[0] if 0 in wanted else load_pt(files[0].skeleton)["optimizer_state_dict"])[
        "optimizer_state_dict"]["state"]
    for g, st in got["optimizer_state_dict"]["state"].items():
        if not torch.equal(torch.as_tensor(st["step"]), torch.as_tensor(base_state[g]["step"])):
            report.add(None, f"rank {rank}: optimizer step of sub-group {g} is not the base's")
    states = load_pt(composed.ranks[rank].model_states)
    source_states = {}
    for name, _shape in plan.base.layout.frozen:
        s = source_of[name]
        if s not in source_states:
            source_states[s] = load_pt(files[s].model_states)
        if not torch.equal(states["frozen_param_fragments"][name],
                           source_states[s]["frozen_param_fragments"][name]):
            report.add(param_row[name], f"rank {rank}: frozen {name} differs from {plan.sources[s].name}")
    base_states = load_pt(files[0].model_states)
    for key in ("global_steps", "global_samples", "skipped_steps", "lr_scheduler"):
        if states.get(key) != base_states.get(key):
            report.add(None, f"rank {rank}: model_states {key} is not the base's")
    counter.finish()


def _verify_model_file(plan, job, report) -> None:
    import torch
    from safetensors import safe_open

    from .model_files import parse_prefix, source_tensor

    out_file = plan.output / job.name
    if not out_file.is_file():
        report.add(None, f"{out_file}: missing (the base has {job.name})")
        return
    index: dict[int, dict[str, Path]] = {}
    for s, paths in job.source_files.items():
        index[s] = {}
        for p in paths:
            with safe_open(p, "pt") as h:
                index[s].update({k: p for k in h.keys()})
    expected = parse_prefix(job.prefix)
    with safe_open(out_file, "pt") as out:
        if set(out.keys()) != set(expected):
            report.add(None, f"{out_file}: holds other tensors than the base's {job.name}")
            return
        for name, (dtype, shape, _begin, _end) in expected.items():
            row = row_of(name)
            s = job.picks.get(row, 0)
            got = out.get_tensor(name)
            if s in job.partial_ranks:  # cast from the partial checkpoint's fp32 masters
                want = source_tensor(job, s, name, dtype, shape)
                same = got.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes() == want
            else:
                with safe_open(index[s][name], "pt") as src:
                    same = torch.equal(got, src.get_tensor(name))
            if not same:
                report.add(row, f"{out_file.name}: {name} differs from {plan.sources[s].name}")
