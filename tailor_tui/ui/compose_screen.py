"""Moved to `tailor_tui.ui.progress_screen` (its screen, `ComposeScreen`, is `ProgressScreen`): this
path keeps working, with a DeprecationWarning."""

from tailor_tui import moved

moved.module(__name__, "tailor_tui.ui.progress_screen", {"ComposeScreen": "ProgressScreen"})
