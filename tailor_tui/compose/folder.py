"""Moved to `tailor_tui.compose.compose_run`: this path keeps working, with a DeprecationWarning."""

from tailor_tui import moved

moved.module(__name__, "tailor_tui.compose.compose_run")
