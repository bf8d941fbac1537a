"""The non-finite rule at the command line (`--apply`, `--export`, with or without `--world-size`): before
anything is written, the rows the output would take NaN/Inf from, by the statistics of the checkpoint each is
taken from (`health.guard.planned_nonfinite`: cached by `--stats`, or computed for those cells, their progress
on stderr). Such an output is refused in one line (exit 8) naming each row, where it comes from and the newest
checkpoint where it is finite; `--dry-run` says the same as a warning; `--allow-nonfinite` is the one way past.
"""

from __future__ import annotations

import sys
from collections import Counter

from tailor_tui.units import shown


def check_nonfinite(plan, args, *, doing: str) -> Counter:
    """{row: NaN/Inf} the output of `plan` would hold (empty: none), checked before anything is written. Raises
    NonFiniteError (`doing`: "compose" or "export", for its advice) unless `args.allow_nonfinite` or
    `args.dry_run`, which print a warning instead (`--allow-nonfinite`: from cached statistics alone, nothing
    read for a decision already made; the writers' count says what the output holds)."""
    from tailor_tui.checkpoints.cache import cache_dir
    from tailor_tui.cli.stats_table import StatsProgress
    from tailor_tui.compose.compose_run import nonfinite_error
    from tailor_tui.health.guard import newest_finite, planned_nonfinite

    report = StatsProgress(sys.stderr, live={"bars": True, "lines": False}.get(args.progress))
    try:
        counts = planned_nonfinite(plan, cache=cache_dir(), workers=args.workers, emit=report,
                                   compute=not args.allow_nonfinite)  # (allowed: no read for it, the cache's word)
    finally:
        report.close()
    if not counts:
        return counts
    error = nonfinite_error(plan, counts, newest_finite, doing=doing)
    if args.allow_nonfinite:
        print(shown(f"warning: --allow-nonfinite: {error}"), file=sys.stderr)
    elif args.dry_run:
        print(shown(f"warning: {error}; --{'apply' if doing == 'compose' else 'export'} refuses it (exit 8)"),
              file=sys.stderr)
    else:
        raise error
    return counts
