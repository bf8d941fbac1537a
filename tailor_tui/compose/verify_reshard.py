"""Moved: the check of a resharded output is `tailor_tui.verifying.resharded` (its model_states
files read once per content: `tailor_tui.verifying.same_content`), which shares no code with the
writers. This old path keeps working, with a DeprecationWarning."""

from __future__ import annotations

_MOVED = {"verify_resharded": "resharded", "whole_matches": "resharded", "BATCH": "resharded",
          "OUTER": "resharded", "REPLACED": "resharded", "SameContent": "same_content"}


def __getattr__(name: str):
    if name in _MOVED:
        import warnings

        from tailor_tui.verifying import resharded, same_content

        where = {"resharded": resharded, "same_content": same_content}[_MOVED[name]]
        warnings.warn(f"tailor_tui.compose.verify_reshard.{name} is now tailor_tui.verifying.{_MOVED[name]}.{name}",
                      DeprecationWarning, stacklevel=2)
        return getattr(where, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
