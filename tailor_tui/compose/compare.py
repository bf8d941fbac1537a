"""Moved: comparing loaded structures byte for byte is `tailor_tui.verifying.compare`, and a
partial checkpoint's slices as the verifier reads them `tailor_tui.verifying.rows_files.RowsFiles`
(`PartialSlices.get` is its `slice`). This old path keeps working, with a DeprecationWarning."""

from __future__ import annotations

from tailor_tui import moved

_names = moved.names(__name__, dict.fromkeys(("same_bytes", "nonzero_bytes", "differences"),
                                             "tailor_tui.verifying.compare"))


def __getattr__(name: str):
    if name == "PartialSlices":  # renamed as it moved: RowsFiles, whose `slice` was `get`
        import warnings

        from tailor_tui.verifying import rows_files

        warnings.warn(f"{__name__}.{name} is now tailor_tui.verifying.rows_files.RowsFiles",
                      DeprecationWarning, stacklevel=2)
        return type("PartialSlices", (rows_files.RowsFiles,), {"get": rows_files.RowsFiles.slice})
    return _names(name)
