"""`tailor-tui --verify RECIPE [--world-size M] [-v]`: a finished composition re-checked against its recipe and
its sources, row by row, a line each (`verifying.against_recipe`)."""

from __future__ import annotations

import os
import sys
from pathlib import Path

from tailor_tui.errors import CheckpointError, ExitCode, OutputError, UsageError
from tailor_tui.units import shown


def verify_command(args) -> int:
    from tailor_tui.checkpoints.dcp_checkpoint import is_dcp
    from tailor_tui.cli.import_command import load_for
    from tailor_tui.planning.build import build_plan
    from tailor_tui.planning.output import recipe_output
    from tailor_tui.planning.provenance import changed_since, read_record, stand_in
    from tailor_tui.progress_bars import reporter_for
    from tailor_tui.verifying.against_recipe import verify_against_recipe

    recipe = load_for(args, args.verify)
    if is_dcp(recipe.base):  # a composition of PyTorch Distributed Checkpoints
        from tailor_tui.planning.dcp_plan import plan_dcp
        from tailor_tui.verifying.dcp_output import verify_dcp

        composed = plan_dcp(recipe, output=args.output, check=False)
        if not composed.output.is_dir():
            raise OutputError(f"output {composed.output}: does not exist; nothing to verify (run --apply first)")
        print(shown(f"verifying {composed.output} against {args.verify}"), file=sys.stderr, flush=True)
        lines = reporter_for(sys.stderr, "lines", unit="compared")
        report = verify_dcp(composed, emit=lines, workers=args.workers or _cores())
        lines.close()
        return _said(args, composed, report)
    out = Path(args.output) if args.output else recipe_output(recipe, written=True)
    record = None if out is None else read_record(out)  # (no output: build_plan says so)
    try:
        plan = build_plan(recipe, output=args.output, check_output=False, world_size=args.world_size,
                          stand_in=None if record is None else lambda path, base: stand_in(record, path, base))
    except CheckpointError as exc:  # a checkpoint it cannot open: gone or changed since the composition?
        changed = changed_since(record) if record is not None else []
        if not changed:
            raise
        for _path, line in changed:
            print(shown(f"CHANGED  {line}"))
        print(shown(f"error: sources changed since the composition ({len(changed)} CHANGED), and {out} cannot be "
                    f"planned without them ({exc}); nothing of it was compared: restore them, or compose again from "
                    "checkpoints that are there"), file=sys.stderr)
        return ExitCode.VERIFY_FAILED
    if not plan.output.is_dir():
        raise OutputError(f"output {plan.output}: does not exist; nothing to verify (run --apply first)")
    if record is not None and isinstance(record.get("export"), dict):
        kind = "a PyTorch Distributed Checkpoint" if record["export"].get("format") == "dcp" else "an HF model folder"
        raise UsageError(f"output {plan.output}: is an export ({kind}, --export), not a composition; --verify checks "
                         "what --apply writes (an export checks every source byte's CRC-32 as it reads it)")
    composed_for = _composed_world_size(record)
    if composed_for is not None and composed_for != plan.world_size:
        raise UsageError(f"output {plan.output}: was composed for {composed_for} ranks, this verification plans "
                         f"{plan.world_size}; verify it with --world-size {composed_for}")
    print(shown(f"verifying {plan.output} against {args.verify}"), file=sys.stderr, flush=True)
    lines = reporter_for(sys.stderr, "lines", unit="compared")
    report = verify_against_recipe(plan, emit=lines, workers=args.workers or _cores(),
                                   record=record if out == plan.output else None)
    lines.close()
    return _said(args, plan, report)


def _said(args, plan, report) -> int:
    """Each row's verdict, a line each, and the exit code (0: verified; 7: a row or a source failed)."""
    width = max(len(r.name) for r in plan.base.rows)
    for row in plan.base.rows:
        if row.tied:
            continue
        source = plan.sources[plan.picks[row.name]].name
        problems = report.problems.get(row.name)
        status = "FAIL" if problems else "ok"
        more = len(problems or ()) - 1
        told = f": {problems[0]}" + (f" (and {more} more: -v lists them)" if more and not args.verbose else "") \
            if problems else ""
        if not problems and row.name in report.by_record:
            told = ": as the composition took it (the CRC-32s its provenance record keeps; the source changed since)"
        print(shown(f"{status:<4}  {row.name:<{width}}  {source}{told}"))  # one line a row
        for extra in (problems or [])[1:] if args.verbose else ():
            print(shown(f"{'':<4}  {'':<{width}}  {extra}"))
    for problem in report.other:
        print(shown(f"FAIL  {problem}"))
    for line in report.changed:
        print(shown(f"CHANGED  {line}"))
    for line in report.unproven:
        print(shown(f"UNPROVEN  {line}"))
    if report.ok:
        print(shown(f"verified: every row of {plan.output} matches its source"))
        return ExitCode.OK
    if report.output_ok:  # nothing wrong found in the output: its sources changed since the composition
        left = (f"; {len(report.unproven)} part(s) that come from them could not be compared (UNPROVEN)"
                if report.unproven else "")
        print(shown(f"error: sources changed since the composition ({len(report.changed)} CHANGED): the "
                    f"rows of {plan.output} (its rank files, its model files' tensors) hold what the composition took "
                    f"(the CRC-32s its provenance record keeps){left}; compose again to check against the "
                    "checkpoints as they are now"),
              file=sys.stderr)
        return ExitCode.VERIFY_FAILED
    bad = sum(1 for p in report.problems.values() if p)
    print(f"error: verification failed: {bad} row(s) and {len(report.other)} other problem(s) differ; "
          "do not resume from this output", file=sys.stderr)
    return ExitCode.VERIFY_FAILED


def _cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:
        return os.cpu_count() or 1


def _composed_world_size(record: dict | None) -> int | None:
    """The world size an output's provenance record says it was composed for (None: not recorded)."""
    if record is None:
        return None
    try:
        size = record.get("world_size") or record["base"]["world_size"]  # resharded, or the base's
    except (AttributeError, KeyError, TypeError):
        return None
    return size if type(size) is int else None
