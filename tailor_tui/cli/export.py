"""Moved to `tailor_tui.cli.export_command`: this path keeps working, with a DeprecationWarning."""

from tailor_tui import moved

moved.module(__name__, "tailor_tui.cli.export_command")
