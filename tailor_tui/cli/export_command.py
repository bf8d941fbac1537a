"""`tailor-tui --export RECIPE --to DIR`: the command line of an export (`export`)."""

from __future__ import annotations

import sys
import threading

from tailor_tui.errors import ExitCode, UsageError
from tailor_tui.events import TaskOptions, progress_of
from tailor_tui.units import shown


def export_command(args) -> int:
    from tailor_tui.checkpoints.dcp_checkpoint import is_dcp
    from tailor_tui.cli.nonfinite_check import check_nonfinite
    from tailor_tui.export.export_plan import plan_export
    from tailor_tui.export.export_run import config_source, run_export
    from tailor_tui.formats.safetensors_out import parse_size
    from tailor_tui.kinds.dcp_rows import DcpSave
    from tailor_tui.planning.build import build_plan
    from tailor_tui.units import size

    if args.to is None:
        raise UsageError("--export needs --to DIR: the folder to write the model to")
    max_shard = parse_size(args.max_shard_size)
    recipe = _recipe_or_checkpoint(args)
    if is_dcp(recipe.base):
        return _export_dcp_to_hf(args, recipe, max_shard)
    plan = build_plan(recipe, output=args.to, force=args.force, preview=args.dry_run)
    dcp = next((src for src in plan.sources if src.saved.kind == DcpSave.kind), None)
    if dcp is not None:
        raise UsageError(f"{dcp.path}: rows taken from a PyTorch Distributed Checkpoint into a ZeRO-3 checkpoint are "
                         "exported once composed: --apply the recipe, then --export its output")
    check_nonfinite(plan, args, doing="export")  # (before anything is written)
    if args.format == "dcp":
        return _export_dcp(args, plan)
    export = plan_export(plan, args.dtype, max_shard)
    source = config_source(export, args.config)
    files = ", ".join(f.name for f in export.files[:3]) + (f" … ({len(export.files)} files)"
                                                            if len(export.files) > 3 else "")
    summary = (f"exporting {plan.output}: {len(export.placed)} tensors in {export.dtype}, "
               f"{size(export.bytes_to_write())} in {files}; config: {source or 'none'}")
    result = _carried_out(args, summary, plan.warnings, (), export.jobs, lambda report: run_export(
        export, config=args.config, workers=args.workers, emit=report, cancel=threading.Event(),
        options=TaskOptions(durable=args.durable)))
    if result is not None and result.config is None:
        _no_config(result.output, "a DeepSpeed-layout run records none")
    return _done(result)


def _carried_out(args, summary: str, warnings, notes, jobs, run):
    """An export's plan said (`summary`, its `warnings` and `notes`), then `run(report)` on the progress of its `jobs`:
    its result; None for a dry run, which writes nothing."""
    from tailor_tui.progress_bars import BarReporter, reporter_for

    if args.dry_run:
        print("\n".join(shown(line) for line in (summary, *notes)))
        print("dry run: nothing written")
        return None
    for line in (*(f"warning: {w}" for w in warnings), summary, *notes):
        print(shown(line), file=sys.stderr, flush=True)
    report = reporter_for(sys.stderr, args.progress, progress_of(jobs))
    try:
        result = run(report)
    finally:
        if isinstance(report, BarReporter):
            report.close()  # the bars' final state, whatever happened
    if not isinstance(report, BarReporter):
        report.close()  # logs: the last line for all the tasks, where many were summed up
    return result


def _no_config(output, why: str) -> None:
    print(shown(f"note: {output} holds the weights but no config.json ({why}); export again with --config PATH "
                "(the model's config.json, or a folder with it and its tokenizer)"), file=sys.stderr)


def _done(result, then: str = "") -> int:
    from tailor_tui.units import size

    if result is not None:
        rate = result.bytes_written / max(result.seconds, 1e-6)
        print(shown(f"done: {result.output} ({size(result.bytes_written)} written in {result.seconds:.1f}s, "
                    f"{size(rate)}/s){then}"))
    return ExitCode.OK


def _recipe_or_checkpoint(args):
    """What `--export X` names: a recipe, or a checkpoint of a run (exported as it is)."""
    from tailor_tui.checkpoints.dcp_checkpoint import is_dcp
    from tailor_tui.checkpoints.scan import run_of_checkpoint
    from tailor_tui.cli.import_command import load_for
    from tailor_tui.planning.recipe import Recipe

    path = args.export
    if path.is_dir() and args.run is None and (is_dcp(path) or run_of_checkpoint(path) is not None):
        return Recipe(base=path)
    return load_for(args, path)


def _export_dcp(args, plan) -> int:
    """`--export --format dcp`: a ZeRO-3 composition as a PyTorch Distributed Checkpoint."""
    from tailor_tui.export.dcp_export_plan import plan_dcp_export
    from tailor_tui.export.dcp_run import run_dcp_export
    from tailor_tui.units import size

    export = plan_dcp_export(plan)
    summary = (f"exporting {plan.output} as a PyTorch Distributed Checkpoint: {export.tensors} tensors (model and "
               f"optimizer state, fp32; param groups for {export.optimizer}), {size(export.bytes_to_write())} in "
               f"{len(export.jobs) + 1} .distcp files")
    notes = ["note: a PEFT run: the checkpoint holds its adapters and their optimizer state; its base model's "
             "weights are the pretrained model's, which DeepSpeed never saved: build the PeftModel from them and load "
             "with dcp.load(..., planner=DefaultLoadPlanner(allow_partial_load=True))"] if export.peft else []
    result = _carried_out(args, summary, plan.warnings, notes, export.jobs, lambda report: run_dcp_export(
        export, workers=args.workers, emit=report, cancel=threading.Event(), options=TaskOptions(durable=args.durable)))
    return _done(result, "; load it with torch.distributed.checkpoint.load and set_state_dict")


def _export_dcp_to_hf(args, recipe, max_shard: int) -> int:
    """`--export` of a composition of PyTorch Distributed Checkpoints (or one) as a plain HF model folder."""
    from tailor_tui.export.dcp_to_hf import plan_dcp_hf, run_dcp_hf_export
    from tailor_tui.export.export_run import config_file
    from tailor_tui.planning.dcp_plan import plan_dcp
    from tailor_tui.units import size

    if args.format == "dcp":
        raise UsageError(f"{recipe.base}: is a PyTorch Distributed Checkpoint already; compose DCP checkpoints into "
                         "one with --apply, or export it as an HF model folder (--format hf)")
    plan = plan_dcp(recipe, output=args.to, force=args.force, preview=args.dry_run)
    export = plan_dcp_hf(plan, args.dtype, max_shard, allow_nonfinite=args.allow_nonfinite)
    config = config_file(args.config) if args.config is not None else None
    summary = (f"exporting {plan.output}: {export.tensors} tensors in {export.dtype or 'their saved dtype'}, "
               f"{size(export.bytes_to_write())} in {len(export.files)} file(s), from PyTorch Distributed "
               f"Checkpoint(s); config: {config or 'none'}")
    result = _carried_out(args, summary, plan.warnings, (), export.jobs, lambda report: run_dcp_hf_export(
        export, config=config, workers=args.workers, emit=report, cancel=threading.Event(),
        options=TaskOptions(durable=args.durable)))
    if result is not None and config is None:
        _no_config(result.output, "a DCP checkpoint records none")
    return _done(result)
