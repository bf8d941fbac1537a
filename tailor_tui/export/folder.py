"""Moved to `tailor_tui.export.export_run`: this path keeps working, with a DeprecationWarning."""

from tailor_tui import moved

moved.module(__name__, "tailor_tui.export.export_run")
