"""Side files crafted for tests: a torch file's records written again by Python's zipfile (stored,
CRC-32s right), its pickle record (data.pkl) changed or a record left out."""

from __future__ import annotations

import io
import zipfile
from pathlib import Path


def rezipped(src: Path, change=lambda data: data, drop: str | None = None) -> bytes:
    """The bytes of `src` written again record by record, its data.pkl through `change`, without the
    record whose name ends with `drop`."""
    out = io.BytesIO()
    with zipfile.ZipFile(src) as z, zipfile.ZipFile(out, "w", zipfile.ZIP_STORED) as new:
        for info in z.infolist():
            if drop is not None and info.filename.endswith(drop):
                continue
            data = z.read(info.filename)
            new.writestr(info.filename, change(data) if info.filename.endswith("/data.pkl") else data)
    return out.getvalue()
