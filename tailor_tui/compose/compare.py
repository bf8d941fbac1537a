"""Moved: comparing loaded structures byte for byte is `tailor_tui.verifying.compare`, and a
partial checkpoint's slices as the verifier reads them `tailor_tui.verifying.rows_files.RowsFiles`
(`PartialSlices.get` is its `slice`). This old path keeps working, with a DeprecationWarning."""

from __future__ import annotations

_MOVED = {"same_bytes": "compare.same_bytes", "nonzero_bytes": "compare.nonzero_bytes",
          "differences": "compare.differences", "PartialSlices": "rows_files.RowsFiles"}


def __getattr__(name: str):
    if name in _MOVED:
        import warnings

        from tailor_tui.verifying import compare, rows_files

        warnings.warn(f"tailor_tui.compose.compare.{name} is now tailor_tui.verifying.{_MOVED[name]}",
                      DeprecationWarning, stacklevel=2)
        if name == "PartialSlices":
            return type("PartialSlices", (rows_files.RowsFiles,), {"get": rows_files.RowsFiles.slice})
        return getattr(compare, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
