"""The layout of a checkpoint's 16-bit model files, without their data: each file's name and
header (its prefix), and the shards' index. Read from a full HF checkpoint's files, or from the
record a partial save keeps (`tailor_model_files.json`), and what an output's model files are
laid out as (`model_files`).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from tailor_tui.checkpoints.checkpoint import MODEL_FILE_INDEX
from tailor_tui.checkpoints.side_files import MAX_RECORD, load_json
from tailor_tui.errors import CheckpointError
from tailor_tui.formats.safetensors_in import header_prefix, parse_prefix, safetensors_header


@dataclass(frozen=True)
class ModelFileLayout:
    """What a checkpoint's 16-bit model files look like, without their data."""

    files: tuple[tuple[str, bytes], ...]  # (file name, prefix: 8-byte length + JSON header)
    index: str | None  # the index file's text when the model is sharded

    @classmethod
    def of_files(cls, files: tuple[Path, ...]) -> "ModelFileLayout":
        prefixes = []
        for f in files:
            _header, start = safetensors_header(f)
            with open(f, "rb") as fh:
                prefixes.append((f.name, fh.read(start)))
        index = files[0].parent / MODEL_FILE_INDEX if files else None
        return cls(tuple(prefixes), index.read_text() if index and index.is_file() else None)

    def to_json(self) -> str:
        return json.dumps({
            "index": self.index,
            "files": {name: prefix[8:].decode() for name, prefix in self.files},
        }, indent=1) + "\n"

    @classmethod
    def read(cls, path: Path) -> "ModelFileLayout":
        try:
            data = load_json(path, limit=MAX_RECORD)
            files = tuple((name, header_prefix(header)) for name, header in data["files"].items())
            for _name, prefix in files:
                parse_prefix(prefix)
            return cls(files, data.get("index"))
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:
            raise CheckpointError(f"{path}: unreadable model-file layout ({exc}); re-copy it") from None
