"""The layout of a checkpoint's 16-bit model files, without their data: each file's name and
header (its prefix), and the shards' index. Read from a full HF checkpoint's files, or from the
record a partial save keeps (`tailor_model_files.json`), and what an output's model files are
laid out as (`model_files`).
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path

from tailor_tui.checkpoints.checkpoint import MODEL_FILE_INDEX
from tailor_tui.checkpoints.side_files import MAX_RECORD, load_json, parse_json, read_small
from tailor_tui.errors import CheckpointError
from tailor_tui.formats.safetensors_in import header_prefix, parse_prefix, safetensors_prefix


@dataclass(frozen=True)
class ModelFileLayout:
    """What a checkpoint's 16-bit model files look like, without their data."""

    files: tuple[tuple[str, bytes], ...]  # (file name, prefix: 8-byte length + JSON header)
    index: str | None  # the index file's text when the model is sharded

    @classmethod
    def of_files(cls, files: tuple[Path, ...]) -> "ModelFileLayout":
        """The layout of `files` (the bytes of each header as checked), the index beside them
        (read as a side file) mapping each tensor to the shard that holds it, as loaders trust it."""
        prefixes: list[tuple[str, bytes]] = []
        held: dict[str, str] = {}  # tensor name -> the file holding it
        for f in files:
            header, prefix = safetensors_prefix(f)
            prefixes.append((f.name, prefix))
            for name in header.keys() - {"__metadata__"}:
                if name in held:
                    raise CheckpointError(f"{f}: holds tensor {name!r}, which {held[name]} holds too; a model's "
                                          "shards hold each tensor once: re-copy the checkpoint")
                held[name] = f.name
        index = files[0].parent / MODEL_FILE_INDEX if files else None
        if not index or not os.path.lexists(index):
            return cls(tuple(prefixes), None)
        try:
            text = read_small(index, MAX_RECORD, within=index.parent.parent).decode("utf-8")
            weight_map = parse_json(text)["weight_map"]
            if not isinstance(weight_map, dict) or not all(isinstance(f, str) for f in weight_map.values()):
                raise ValueError("its weight_map is not a table of tensor names to file names")
        except (OSError, ValueError, KeyError, TypeError) as exc:
            raise CheckpointError(f"{index}: unreadable index ({exc}); re-copy it") from None
        if weight_map != held:
            wrong = sorted(set(weight_map.items()) ^ set(held.items()))[0][0]
            said = (f"does not map tensor {wrong!r}" if wrong not in weight_map else
                    f"maps tensor {wrong!r} to {weight_map[wrong]!r}")
            raise CheckpointError(f"{index}: {said}, but {held[wrong] if wrong in held else 'no shard'} holds it; "
                                  "the index does not agree with its shards: re-copy the checkpoint")
        return cls(tuple(prefixes), text)

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
