"""Moved: the check of an output against its recipe is `tailor_tui.verifying.recipe`, which shares
no code with the writers. This old path keeps working, with a DeprecationWarning."""

from __future__ import annotations

_MOVED = ("VerifyReport", "verify_against_recipe")


def __getattr__(name: str):
    if name in _MOVED:
        import warnings

        from tailor_tui.verifying import recipe

        warnings.warn(f"tailor_tui.compose.verify.{name} is now tailor_tui.verifying.recipe.{name}",
                      DeprecationWarning, stacklevel=2)
        return getattr(recipe, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
