"""`tailor-tui RUN_DIR` (and `--demo`): the interactive composer, started on a terminal; how it ended, as an exit
code (an internal error that ended it: one line, its traceback in a log file)."""

from __future__ import annotations

import sys
from pathlib import Path

from tailor_tui.errors import ExitCode, UsageError


def interactive(run_dir: Path, recipe: Path | None, workers: int | None) -> int:
    from tailor_tui.checkpoints.scan import check_run_folder

    check_run_folder(run_dir)
    if recipe is not None and recipe.is_dir():
        raise UsageError(f"--recipe {recipe}: is a folder; name the recipe file to load or save, e.g. "
                         f"{recipe / 'fix.yaml'}")
    if not sys.stdout.isatty():
        raise UsageError("the interactive composer needs a terminal; for batch jobs use --apply RECIPE")
    from tailor_tui.ui.app import make_app

    app = make_app(run_dir, recipe=recipe, workers=workers)
    app.run()
    return ended(app)


def ended(app) -> int:
    """The exit code of a composer that has ended: an internal error that ended it is one line
    on stderr, its traceback in a log file (`crash`), and exit code 1."""
    from tailor_tui.cli.crash import crash_line, log_crash

    if app.crash is not None:
        print(crash_line(app.crash, log_crash(app.crash)), file=sys.stderr)
        return ExitCode.INTERNAL
    return app.return_code or ExitCode.OK
