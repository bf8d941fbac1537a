"""The headless front end: the command line (`main`: the options, which go with which, and each action's
command), one module per command: `--apply` (`apply_command`, a DCP run's in `dcp_apply`), `--verify`
(`verify_command`), `--export` (`export_command`), `--stats` and `--heal` (`health_command`, the statistics
table: `stats_table`), `--import` (`import_command`), `--make-demo` (`demo_command`), the interactive composer
(`composer_command`); a crash's report (`crash`). Its API is the command line: `tailor-tui`, `python -m
tailor_tui.cli`, and `main` (`tailor_tui.cli.main.main`, the entry point).
"""

__all__ = ["main"]
