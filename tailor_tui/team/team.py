"""Moved to `tailor_tui.team.members`: this path keeps working, with a DeprecationWarning."""

from tailor_tui import moved

moved.module(__name__, "tailor_tui.team.members")
