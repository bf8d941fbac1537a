"""`tailor-tui --apply RECIPE` where the recipe's base is a PyTorch Distributed Checkpoint (an FSDP2 run's
`step-N`, or the HF Trainer's FSDP `checkpoint-N`): the composition planned (`planning.dcp_plan`) and written
(`compose.dcp_compose`), a DCP checkpoint FSDP2 loads (`dcp.load` + `set_state_dict`) at any world size."""

from __future__ import annotations

import sys
import threading

from tailor_tui.errors import ExitCode, UsageError
from tailor_tui.events import TaskOptions, progress_of
from tailor_tui.units import shown


def apply_dcp(args, recipe) -> int:
    from tailor_tui.compose.dcp_compose import run_dcp_compose
    from tailor_tui.export.dcp_rank import export_dcp_rank
    from tailor_tui.planning.dcp_plan import plan_dcp
    from tailor_tui.progress_bars import reporter_for
    from tailor_tui.units import size

    if args.world_size or recipe.world_size:
        raise UsageError(f"{recipe.location('base')}: a PyTorch Distributed Checkpoint loads at any world size; "
                         "--world-size and `world_size:` are for ZeRO-3 outputs")
    plan = plan_dcp(recipe, output=args.output, force=args.force, preview=args.dry_run,
                    allow_nonfinite=args.allow_nonfinite)
    _check_zero_rows(plan, args.allow_nonfinite)  # (before anything is written; DCP rows: as their archives are read)
    if args.dry_run:
        print("\n".join(map(shown, plan.describe())))
        print("dry run: nothing written")
        return ExitCode.OK
    for warning in plan.warnings:
        print(shown(f"warning: {warning}"), file=sys.stderr)
    print(shown(f"composing {plan.output} from {len(plan.sources)} PyTorch Distributed Checkpoint(s): "
                f"{size(plan.bytes_to_write())} to write in {len(plan.jobs)} file(s)"), file=sys.stderr, flush=True)
    report = reporter_for(sys.stderr, args.progress, progress_of(plan.jobs))
    try:
        result = run_dcp_compose(plan, workers=args.workers, emit=report, cancel=threading.Event(),
                                 options=TaskOptions(durable=args.durable, clone=args.clone),
                                 write_rows=export_dcp_rank)
    finally:
        report.close()
    if result.bytes_shared:
        print(shown(f"sharing the base's blocks ({result.shared_how}): {size(result.bytes_shared)} of its files cloned, "
                    "their archives read and checked, not written"))
    rate = result.bytes_written / max(result.seconds, 1e-6)
    trainer = plan.base.run_files() or plan.base.parts != ("",)
    load = ("resume the HF Trainer from it (resume_from_checkpoint)" if trainer
            else "load it with torch.distributed.checkpoint.load and set_state_dict")
    print(shown(f"done: {result.output} ({size(result.bytes_written)} written in {result.seconds:.1f}s, "
                f"{size(rate)}/s); {load}"))
    return ExitCode.OK


def _check_zero_rows(plan, allow_nonfinite: bool) -> None:
    """Refuse rows taken from a ZeRO-3 checkpoint whose statistics find NaN/Inf in them (`health.guard`: cached by
    --stats, else computed for that checkpoint), unless --allow-nonfinite: a DCP source's are refused as its
    archives are read, a ZeRO-3 source's are written by the export's writer, which counts none."""
    from tailor_tui.checkpoints.cache import cache_dir
    from tailor_tui.checkpoints.checkpoint import Checkpoint
    from tailor_tui.errors import NonFiniteError
    from tailor_tui.health.guard import rows_nonfinite

    if allow_nonfinite:
        return
    for s, src in enumerate(plan.sources):
        if isinstance(src, Checkpoint):
            found = rows_nonfinite(src, [row for row, i in plan.picks.items() if i == s], cache=cache_dir())
            if found:
                row, count = next(iter(found.items()))
                raise NonFiniteError(f"row {row} holds {count:,} NaN/Inf values in {src.path}: the output would hold "
                                     f"them; pick a checkpoint where that row is finite, or pass --allow-nonfinite")
