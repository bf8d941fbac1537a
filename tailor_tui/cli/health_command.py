"""`--stats RUN_DIR` (the health of every row in every checkpoint) and `--heal RUN_DIR --recipe
OUT.yaml` (the recipe taking every row where it is healthy), over one process or a job of many."""

from __future__ import annotations

import os
import sys
import threading
from pathlib import Path

from tailor_tui.errors import CheckpointError, ExitCode, UsageError
from tailor_tui.planning.recipe import check_recipe_target
from tailor_tui.units import shown


def _health(run_dir: Path, args, progress: str):
    """The scanned run's health (training checkpoints: not tailor-tui's own outputs); None in a
    process of a job other than process 0 (which alone holds every cell)."""
    from tailor_tui.checkpoints.cache import cache_dir
    from tailor_tui.checkpoints.dcp_checkpoint import scan_dcp
    from tailor_tui.checkpoints.lineage import check_one_run
    from tailor_tui.checkpoints.scan import check_run_folder, scan
    from tailor_tui.cli.stats_table import StatsProgress
    from tailor_tui.health.dcp_stats import dcp_health
    from tailor_tui.health.stats_run import compute_health
    from tailor_tui.team.launch import detect
    from tailor_tui.team.meet import connect
    from tailor_tui.team.members import SOLO

    check_run_folder(run_dir)
    dcp = scan_dcp(run_dir)
    if dcp:  # an FSDP2 run's PyTorch Distributed Checkpoints
        shown_progress = StatsProgress(sys.stderr, live={"bars": True, "lines": False}.get(progress))
        try:
            return dcp_health(dcp, emit=shown_progress, cache=cache_dir())
        finally:
            shown_progress.close()
    scanned = scan(run_dir)
    for _folder, problem in scanned.problems:
        print(shown(f"warning: skipped {problem}"), file=sys.stderr)
    checkpoints = scanned.checkpoints  # tailor-tui's own outputs are never among them
    if not checkpoints:
        raise CheckpointError(scanned.nothing_found(run_dir))
    check_one_run(run_dir, checkpoints)
    launch = detect(os.environ, args.distributed)
    team = connect(launch, args.peer_timeout, meeting=cache_dir()) if launch else SOLO
    # in a job of several processes process 0 reports; the others read their share quietly
    report = StatsProgress(sys.stderr, live={"bars": True, "lines": False}.get(progress)) if team.lead else None
    cancel = threading.Event()
    try:
        health = compute_health(checkpoints, workers=args.workers, emit=report or (lambda event: None),
                                cancel=cancel, cache=cache_dir(), team=team)
    finally:
        if report is not None:
            report.close()
    if not team.lead:
        return None
    assert report is not None, "process 0 reports"
    for note in dict.fromkeys(log.note for log in health.logs.values() if log.note):
        print(shown(f"note: {note}"), file=sys.stderr)  # what of a training log was ignored
    if args.report_peak_rss:
        print(f"peak RSS: {report.peak_rss} bytes", file=sys.stderr)
    return health


def stats_command(args) -> int:
    import json

    from tailor_tui.cli.stats_table import table

    health = _health(args.stats, args, args.progress)
    if health is None:
        return ExitCode.OK  # process 0 of the job prints the statistics
    if args.json:
        print(json.dumps(health.to_json(), indent=1))
    else:
        print("\n".join(map(shown, table(health))))
    bad = [(row, health.checkpoints[i].name) for (row, i), cell in health.cells.items() if not cell.healthy]
    if args.check and bad:
        listed = ", ".join(f"{row} in {name}" for row, name in bad[:3]) + (" …" if len(bad) > 3 else "")
        print(shown(f"error: {len(bad)} unhealthy cell(s) ({listed}); tailor-tui --heal {args.stats} "
                    "--recipe fix.yaml writes the recipe that takes each row where it is healthy"), file=sys.stderr)
        return ExitCode.NONFINITE
    return ExitCode.OK


def heal_command(args) -> int:
    from tailor_tui.checkpoints.dcp_checkpoint import DcpCheckpoint
    from tailor_tui.cli.stats_table import healing_lines
    from tailor_tui.health.healing import heal
    from tailor_tui.planning.recipe_draft import RecipeDraft

    if args.recipe is None:
        raise UsageError("--heal needs --recipe OUT.yaml: where to write the recipe it makes")
    check_recipe_target(args.recipe, args.force)  # before any statistics are computed
    health = _health(args.heal, args, args.progress)
    if health is None:
        return ExitCode.OK  # process 0 of the job writes the recipe
    if isinstance(health.checkpoints[-1], DcpCheckpoint):
        return _heal_dcp(args, health)
    comp = RecipeDraft.start(list(health.checkpoints))
    healing = heal(health, comp.healable_rows(), usable=comp.combines_with)
    comp.apply_healing(healing.picks)
    _check_copied_files(comp.to_recipe())  # a recipe that --apply would refuse is not written
    saved = comp.save(args.recipe)
    base = comp.base_checkpoint.name
    lines = healing_lines(health, healing, comp.base)
    print(shown(f"base: {base}; {len(comp.picks)} row(s) from other checkpoints"))
    print("\n".join(map(shown, lines)) if lines else shown(f"every row is healthy in {base}"))
    if healing.hopeless:
        print(shown(f"error: {len(healing.hopeless)} row(s) have no healthy checkpoint ({', '.join(healing.hopeless)}); "
                    f"{saved} keeps them from {base}: --apply refuses it without --allow-nonfinite"), file=sys.stderr)
        return ExitCode.NONFINITE
    print(shown(f"wrote {saved}; compose it with: tailor-tui --apply {saved}"))
    return ExitCode.OK


def _heal_dcp(args, health) -> int:
    """`--heal` of a DCP run: its newest checkpoint the base, every row from the newest checkpoint where it is
    healthy (`healing.heal`, the one rule)."""
    from tailor_tui.cli.stats_table import healing_lines
    from tailor_tui.health.healing import heal
    from tailor_tui.planning.output import default_output
    from tailor_tui.planning.recipe import Recipe
    from tailor_tui.planning.recipe_file import save_recipe

    base = len(health.checkpoints) - 1
    healing = heal(health, [r.name for r in health.checkpoints[base].rows if not r.tied])
    newest = health.checkpoints[base]
    recipe = Recipe(base=newest.path, output=default_output(newest.path),
                    layers={row: health.checkpoints[i].path for row, i in healing.picks.items() if i != base})
    saved = save_recipe(recipe, args.recipe)
    lines = healing_lines(health, healing, base)
    print(shown(f"base: {newest.name}; {len(recipe.layers)} row(s) from other checkpoints"))
    print("\n".join(map(shown, lines)) if lines else shown(f"every row is healthy in {newest.name}"))
    if healing.hopeless:
        print(shown(f"error: {len(healing.hopeless)} row(s) have no healthy checkpoint ({', '.join(healing.hopeless)}); "
                    f"{saved} keeps them from {newest.name}: --apply refuses it without --allow-nonfinite"),
              file=sys.stderr)
        return ExitCode.NONFINITE
    print(shown(f"wrote {saved}; compose it with: tailor-tui --apply {saved}"))
    return ExitCode.OK


def _check_copied_files(recipe) -> None:
    """Every file the recipe's output would take whole from its base (RNG states, scheduler,
    training arguments) loads as torch reads it (`side_pickles`: CheckpointError naming the file and why)."""
    from tailor_tui.formats.side_pickles import check_side_file
    from tailor_tui.planning.build import build_plan

    plan = build_plan(recipe, preview=True)
    root = plan.other_files_root()
    for rel, _to in plan.other_files():
        check_side_file(root / rel)
