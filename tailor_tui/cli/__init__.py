"""The headless front end: the command line (`main`), `--export` (`export_command`), `--verify`
(`verify_command`), `--stats` and
`--heal` (`health_command`), the statistics report (`health_report`), a crash's report (`crash`).

Its API is the command line (`main`); the old module `tailor_tui.cli`'s names are old paths, found
in `main` and `health_command` (a DeprecationWarning names their module). Its `main` is the module
`tailor_tui.cli.main` now, whose `main` function is the entry point.
"""

from tailor_tui import moved

__all__ = ["main"]
__getattr__ = moved.names(__name__, {
    **dict.fromkeys(("parser", "apply", "interactive", "make_demo", "ensure_demo"), f"{__name__}.main"),
    "verify": f"{__name__}.verify_command:verify_command",
    "stats": f"{__name__}.health_command:stats_command", "heal": f"{__name__}.health_command:heal_command"})
