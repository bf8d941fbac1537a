"""Moved: the check of a resharded output is `tailor_tui.verifying.resharded` (its model_states
files read once per content: `tailor_tui.verifying.same_content`), which shares no code with the
writers. This old path keeps working, with a DeprecationWarning."""

from __future__ import annotations

from tailor_tui import moved

__getattr__ = moved.names(__name__, {
    **dict.fromkeys(("verify_resharded", "OUTER", "REPLACED"), "tailor_tui.verifying.resharded"),
    "SameContent": "tailor_tui.verifying.same_content"})
