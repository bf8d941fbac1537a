"""Moved: the check of an output against its recipe is `tailor_tui.verifying.against_recipe`, which shares
no code with the writers. This old path keeps working, with a DeprecationWarning."""

from __future__ import annotations

from tailor_tui import moved

__getattr__ = moved.names(__name__, dict.fromkeys(("VerifyReport", "verify_against_recipe"),
                                                  "tailor_tui.verifying.against_recipe"))
