"""The names transformers saves a model's parameters under, told back to the parameters' own.

transformers 5 writes a model's weight files under the names of its checkpoint conversion
mapping, not always its module names (which DeepSpeed partitions): BEiT's `beit.layers.N.…` are
saved as `beit.encoder.layer.N.…`, a Llava's `model.language_model.layers.N.…` as
`language_model.model.layers.N.…`, GPT-NeoX's `lm_head` as `embed_out`. `loading_names(folder)`
renames a saved name as `from_pretrained` would when it loads the checkpoint: with the installed
transformers' own transforms for the model class `folder/config.json` names (its
`architectures`), worked out on a model made on the meta device (no weights, nothing
downloaded). The config is the checkpoint's, so it is read as input: only a model class of
transformers is ever made from it (a name of anything else in `architectures` is passed over), and
none where it asks for more than MAX_LAYERS layers. Where that cannot be done (an older
transformers, a class it does not know), its table for the config's `model_type` or class name
serves, as far as it goes.

Making that model means importing torch and transformers: seconds of a command's start. So
`loaded_names(folder, names)` caches what it found for a weight file's names (JSON, under
`cache.cache_dir()`), keyed by the config, the names and the installed transformers' and torch's
releases: the next command reading the same checkpoint imports neither.
"""

from __future__ import annotations

import functools
import hashlib
import json
import re
from collections.abc import Iterable
from pathlib import Path
from typing import Callable

from tailor_tui.checkpoints.cache import cache_dir, entry, read_json, write_json
from tailor_tui.checkpoints.side_files import load_json

Rename = Callable[[str], str]

NAMES_FORMAT = 1  # of the cached names: bump when what loading_names does changes
MAX_CACHED_NAMES = 16 << 20  # a cached entry larger than this is not one of ours (a model's names: ~100 KiB)


def loading_names(folder: Path) -> Rename | None:
    """How loading `folder`'s checkpoint names a saved tensor (a function of the saved name), or
    None where its config names no architecture transformers knows."""
    config = _config(folder)
    return None if config is None else _renamer(config)


def loaded_names(folder: Path, names: Iterable[str]) -> dict[str, str] | None:
    """Each of `names` (tensors saved in a weight file of `folder`) -> the name loading the checkpoint
    gives it (`loading_names`), or None where that is None; what was found is cached (see above), and
    a cached entry is used only where it answers for exactly these names."""
    config = _config(folder)
    if config is None:
        return None
    wanted = sorted(set(names))
    key = hashlib.sha256(json.dumps([NAMES_FORMAT, _releases(), config, wanted]).encode()).hexdigest()
    path = entry(cache_dir(), "names", key)
    cached = read_json(path, MAX_CACHED_NAMES)
    if isinstance(cached, dict) and "renamed" in cached:
        found = cached["renamed"]
        if found is None or (isinstance(found, dict) and sorted(found) == wanted
                             and all(isinstance(v, str) for v in found.values())):
            return found
    rename = _renamer(config)
    found = None if rename is None else {name: rename(name) for name in wanted}
    write_json(path, {"renamed": found})
    return found


def _config(folder: Path) -> str | None:
    """`folder/config.json`, canonical (keys sorted), or None where there is none that is an object."""
    config = folder / "config.json"
    try:
        data = load_json(config) if config.is_file() else None
    except (OSError, ValueError):
        return None
    return json.dumps(data, sort_keys=True) if isinstance(data, dict) else None


def _releases() -> list[str | None]:
    """The installed transformers' and torch's releases (what the names found depend on), read
    from their metadata: neither is imported."""
    import importlib.metadata  # (~20 ms: a composition of a checkpoint with no model file never needs it)

    found: list[str | None] = []
    for package in ("transformers", "torch"):
        try:
            found.append(importlib.metadata.version(package))
        except importlib.metadata.PackageNotFoundError:
            found.append(None)
    return found


@functools.lru_cache(maxsize=8)
def _renamer(config: str) -> Rename | None:
    data = json.loads(config)
    return _by_model(data) or _by_table(data)


def _by_model(data: dict) -> Rename | None:
    """transformers' own renaming, from the transforms of the model class the config names."""
    try:
        import torch
        import transformers
        from transformers.conversion_mapping import get_model_conversion_mapping
        from transformers.core_model_loading import WeightConverter, WeightRenaming, rename_source_key
    except ImportError:
        return None
    if _too_deep(data):
        return None
    for arch in data.get("architectures") or []:
        cls = getattr(transformers, arch, None) if isinstance(arch, str) else None
        if not (isinstance(cls, type) and issubclass(cls, transformers.PreTrainedModel)):
            continue  # a name of the config is never anything of transformers' but a model class
        try:
            config = transformers.AutoConfig.for_model(**data)
            with torch.device("meta"):
                model = cls(config)
            transforms = get_model_conversion_mapping(model, add_legacy=True)
        except Exception:  # noqa: BLE001 - a config this transformers cannot build: the table then
            continue
        renamings = [t for t in transforms if isinstance(t, WeightRenaming)]
        converters = [t for t in transforms if isinstance(t, WeightConverter)]
        if not renamings and not converters:
            return None

        def rename(name: str, renamings=renamings, converters=converters) -> str:
            try:
                return rename_source_key(name, renamings, converters)[0]
            except Exception:  # noqa: BLE001 - a name transformers' patterns choke on: as it is
                return name

        return rename
    return None


MAX_LAYERS = 10_000  # a config's layer counts beyond this are no model's: its model is not made


def _too_deep(value, depth: int = 0) -> bool:
    """Whether a config (read from the checkpoint: crafted, perhaps) asks for more layers than any
    model has, anywhere in its sub-configs (a model of millions of modules takes long even on meta)."""
    if depth > 8:
        return True
    if isinstance(value, dict):
        return any((isinstance(v, int) and "layers" in k and v > MAX_LAYERS) or _too_deep(v, depth + 1)
                   for k, v in value.items())
    if isinstance(value, list):
        return any(_too_deep(v, depth + 1) for v in value)
    return False


def _by_table(data: dict) -> Rename | None:
    """transformers' table of renamings for the config's class or `model_type` (one-to-one ones)."""
    try:
        from transformers.conversion_mapping import get_checkpoint_conversion_mapping
    except ImportError:
        return None
    found = []
    for key in [*(data.get("architectures") or []), data.get("model_type")]:
        if not isinstance(key, str):
            continue
        try:
            transforms = get_checkpoint_conversion_mapping(key) or []
        except Exception:  # noqa: BLE001 - transformers' table, whatever its version: no renamings then
            continue
        for t in transforms:
            if type(t).__name__ != "WeightRenaming":
                continue
            sources, targets = t.source_patterns, t.target_patterns
            sources = [sources] if isinstance(sources, str) else list(sources)
            targets = [targets] if isinstance(targets, str) else list(targets)
            if len(targets) == 1:
                found += [(s, targets[0]) for s in sources if isinstance(s, str)]
    if not found:
        return None

    def rename(name: str) -> str:
        for pattern, target in found:
            renamed = re.sub(pattern, target, name)
            if renamed != name:
                return renamed
        return name

    return rename
