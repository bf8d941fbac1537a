"""The headless front end: the command line (`main`: the options, which go with which, and each action's
command), one module per command: `--apply` (`apply_command`, a DCP run's in `dcp_apply`), `--verify`
(`verify_command`), `--export` (`export_command`), `--stats` and `--heal` (`health_command`, the statistics
report: `health_report`), `--import` (`import_command`), `--make-demo` (`demo_command`), the interactive composer
(`composer_command`); a crash's report (`crash`).

Its API is the command line (`main`); the old module `tailor_tui.cli`'s names are old paths, found in the
command modules (a DeprecationWarning names their module). Its `main` is the module `tailor_tui.cli.main` now,
whose `main` function is the entry point.
"""

from tailor_tui import moved

__all__ = ["main"]
__getattr__ = moved.names(__name__, {
    "parser": f"{__name__}.main",
    "apply": f"{__name__}.apply_command:apply_command",
    **dict.fromkeys(("interactive",), f"{__name__}.composer_command"),
    "make_demo": f"{__name__}.demo_command:make_demo_command", "ensure_demo": f"{__name__}.demo_command",
    "verify": f"{__name__}.verify_command:verify_command",
    "stats": f"{__name__}.health_command:stats_command", "heal": f"{__name__}.health_command:heal_command"})
