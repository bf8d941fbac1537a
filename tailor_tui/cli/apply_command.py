"""`tailor-tui --apply RECIPE`: compose a recipe's output headless (a DCP run's: `dcp_apply`), alone or as one
process of a Slurm / torchrun job (`team`), with progress per rank and one line when done."""

from __future__ import annotations

import os
import sys
import threading

from tailor_tui.errors import ExitCode
from tailor_tui.events import TaskOptions
from tailor_tui.units import shown


def apply_command(args) -> int:
    from tailor_tui.checkpoints.dcp_checkpoint import is_dcp
    from tailor_tui.cli.import_command import load_for
    from tailor_tui.cli.nonfinite_check import check_nonfinite
    from tailor_tui.compose.compose_run import planned_tasks, run_compose
    from tailor_tui.health.guard import newest_finite
    from tailor_tui.planning.build import build_plan
    from tailor_tui.progress_bars import FEW, BarReporter, LineReporter, reporter_for
    from tailor_tui.team.launch import detect
    from tailor_tui.team.meet import connect
    from tailor_tui.team.members import SOLO
    from tailor_tui.team.progress import JobLines
    from tailor_tui.team.workers import default_workers
    from tailor_tui.units import size

    launch = None if args.dry_run else detect(os.environ, args.distributed)
    recipe = load_for(args, args.apply)
    if is_dcp(recipe.base):  # an FSDP2 run's PyTorch Distributed Checkpoint
        from tailor_tui.cli.dcp_apply import apply_dcp

        return apply_dcp(args, recipe)
    plan = build_plan(recipe, output=args.output, force=args.force, preview=args.dry_run, world_size=args.world_size)
    check_nonfinite(plan, args, doing="compose")  # (before anything is written; every process of a job alike)
    if args.dry_run:
        print("\n".join(map(shown, plan.describe(clone=args.clone))))  # a line per line, whatever the names
        print("dry run: nothing written")
        return ExitCode.OK
    team = connect(launch, args.peer_timeout, meeting=plan.output.parent) if launch else SOLO
    if team.lead:
        for warning in plan.warnings:
            print(shown(f"warning: {warning}"), file=sys.stderr)
    workers = args.workers or default_workers(plan)
    unit = plan.progress_unit(clone=args.clone)  # "composed" where the output may share the base's blocks
    ranks = f"{plan.base.world_size} → {plan.world_size}" if plan.reshard else plan.world_size
    if team.lead:
        processes = f"{team.size} processes ({launch.via}) × " if launch is not None and team.size > 1 else ""
        print(
            shown(f"composing {plan.output} from {len(plan.sources)} checkpoint(s): {ranks} ranks, "
            f"{processes}{workers} worker(s), {'about ' if plan.rewritten_files() else ''}"
            f"{size(plan.bytes_to_write())} to "
            + (f"compose (on {plan.shares(clone=args.clone)}: a file mostly kept starts as a clone of the base's, "
               "only what the recipe replaces written into it)" if unit == "composed" else "write")),
            file=sys.stderr,
            flush=True,
        )
    report: JobLines | LineReporter | BarReporter
    if team.lead and team.size > 1:  # the whole job's lines (every process's tasks) and its throughput
        report = JobLines(sys.stderr, planned_tasks(plan), unit=unit)
    elif team.size > 1:  # several processes share the log: lines, each saying whose (its tasks' sum, if many)
        report = LineReporter(sys.stderr, prefix=f"[process {team.rank}] ", unit=unit,
                              each=len(planned_tasks(plan)) <= FEW)
    else:
        report = reporter_for(sys.stderr, args.progress, planned_tasks(plan), unit=unit)
    cancel = threading.Event()
    options = TaskOptions(durable=args.durable, clone=args.clone)
    try:
        result = run_compose(plan, workers=workers, emit=report, cancel=cancel, options=options,
                           allow_nonfinite=args.allow_nonfinite, team=team, newest_finite=newest_finite)
    finally:
        if isinstance(report, BarReporter):
            report.close()  # the bars' final state, whatever happened
    if not isinstance(report, BarReporter):
        report.close()  # logs: the last line for all the tasks, where many were summed up
    if not team.lead:
        return ExitCode.OK  # process 0 says how the job went
    if result.nonfinite:
        print(shown("warning: composed with --allow-nonfinite: the output holds NaN/Inf values in "
                    + ", ".join(f"{row} ({n:,})" for row, n in result.nonfinite.items())), file=sys.stderr)
    if args.report_peak_rss:
        print(f"peak RSS: {result.peak_rss} bytes", file=sys.stderr)
    rate = result.bytes_written / max(result.seconds, 1e-6)
    unread = result.unread()
    if result.bytes_shared:
        kept = f" ({unread.pop(0)})" if result.kept_checked else ""
        print(shown(f"sharing its sources' blocks ({result.shared_how}): "
                    f"{size(result.bytes_written - result.bytes_shared)} written, {size(result.bytes_shared)} shared"
                    + kept))
    for line in unread:
        print(shown(line))
    print(shown(f"done: {result.output} ({result.amount()} in {result.seconds:.1f}s, {size(rate)}/s)"))
    return ExitCode.OK
