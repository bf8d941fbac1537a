"""An internal error that ends the interactive composer or a headless command: its traceback goes
to a log file and the terminal gets one line, `error: ...`, saying what broke and where the
traceback is (the composer's alternate screen is gone by then, and a page of traceback with locals
helps nobody read it; a batch job's log keeps one line per failure)."""

from __future__ import annotations

import os
import tempfile
import time
import traceback
from pathlib import Path

from tailor_tui.checkpoints.cache import cache_dir
from tailor_tui.units import shown


def log_crash(error: BaseException) -> Path | None:
    """Write `error`'s traceback to a new file in the user's cache folder (`crashes/`), else in
    the temporary folder; its path, or None if neither could be written. A new file each time,
    created exclusively (mkstemp): never one a symbolic link points elsewhere."""
    text = "".join(traceback.format_exception(error))
    for folder in (cache_dir() / "crashes", Path(tempfile.gettempdir())):
        try:
            folder.mkdir(parents=True, exist_ok=True)
            fd, name = tempfile.mkstemp(prefix=time.strftime("tailor-tui-crash-%Y%m%d-%H%M%S-"), suffix=".log",
                                        dir=folder)
        except OSError:
            continue
        with os.fdopen(fd, "w", encoding="utf-8", errors="backslashreplace") as log:
            log.write(text)
        return Path(name)
    return None


def crash_line(error: BaseException, log: Path | None, *, who: str = "the composer") -> str:
    """The one line that says `who` stopped on it (escaped: the error may quote a hostile name)."""
    where = f"its traceback is in {log}" if log else "its traceback could not be written anywhere"
    return shown(f"error: {who} stopped on an internal error ({type(error).__name__}: {error}); {where}; "
                 "please report it")
