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
only one of bounded size (below). Where that cannot be done (an older transformers, a class it does
not know, a model too large), its table for the config's `model_type` or class name serves, as far
as it goes; a tensor whose name is still no row's is then refused by name (`weight_files`).

The size of the model made is bounded twice. On the meta device its weights cost nothing, whatever
their widths (hidden sizes of 2^20, vocabularies and positions of 10^9 make a Llama, GPT-2, BERT,
T5, OPT, BEiT, Whisper or Qwen2-VL in milliseconds: not bounded, real ones reach tens of millions);
what costs is the Python objects of its modules, parameters and buffers, ~1.5 KiB and 20-120 µs
each here — so the count of parts, which the config's counts multiply (layers, blocks, experts of a
model that makes a module of each, heads). transformers' ~560 configs name those counts dozens of
ways (`n_layer`, `num_layers`, `encoder_layers`, `depths: [2, 2, 6, 2]`, `inner_group_num`,
`vision_config.depth`; a Nemotron-H's layers are the characters of `hybrid_override_pattern`), so
no list of keys is complete:

- before anything is imported, `_oversized` reads the whole config (any key, any depth) and no
  model is made where it holds an integer over MAX_COUNT under a key naming a count (layer, block,
  depth, expert, stage, repeat, cycle, loop, group, head; not a size, dim, vocab, channel or rotary
  base), a list longer than MAX_COUNT, or nesting past MAX_NESTING. None of the ~820 default configs
  of transformers does (Doge's 16,384 experts, embeddings of one row each, are the most): this turns
  the absurd away cheaply, and keeps small what a config does itself (its lists of `layer_types`);
- while a model is made, `_bounded_parts` counts every module, parameter and buffer torch registers
  (its global registration hooks) and stops the making past MAX_PARTS, whatever asked for them;
  then no model is made of this config at all. Real models hold far fewer (Llama 3.1 405B 2,783;
  DeepSeek-V3, its experts one module, 2,183; NLLB-MoE 7,870); only the largest of the few whose
  experts are a module each go past (Switch-Large-128 ~23,000, Switch-C 431,020: read by the table).
  Tripping it costs ~30 MiB and a second or two, beside the ~300 MiB and seconds of importing torch
  and transformers that making any model here costs. The count is the same on every machine, so
  what is found is cached alike.

The model is made as `from_pretrained` makes one, without drawing initial weights
(`no_init_weights`): GPT-2 draws each on meta through torch's reference code, 3 ms a weight.

Making that model means importing torch and transformers: seconds of a command's start. So
`loaded_names(folder, names)` caches what it found for a weight file's names (JSON, under
`cache.cache_dir()`), keyed by the config, the names and the installed transformers' and torch's
releases: the next command reading the same checkpoint imports neither.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import json
import re
from collections.abc import Iterable
from pathlib import Path
from typing import Callable

from tailor_tui.checkpoints.cache import cache_dir, entry, read_json, write_json
from tailor_tui.checkpoints.side_files import load_json
from tailor_tui.kinds.folders import MODEL_CONFIG

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
    config = folder / MODEL_CONFIG
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
    if _oversized(data):
        return None
    try:
        import torch
        import transformers
        from transformers.conversion_mapping import get_model_conversion_mapping
        from transformers.core_model_loading import WeightConverter, WeightRenaming, rename_source_key
    except ImportError:
        return None
    for arch in data.get("architectures") or []:
        cls = getattr(transformers, arch, None) if isinstance(arch, str) else None
        if not (isinstance(cls, type) and issubclass(cls, transformers.PreTrainedModel)):
            continue  # a name of the config is never anything of transformers' but a model class
        try:
            config = transformers.AutoConfig.for_model(**data)
            with _bounded_parts(MAX_PARTS), torch.device("meta"), _no_init():
                model = cls(config)
            transforms = get_model_conversion_mapping(model, add_legacy=True)
        except _TooLarge:
            return None  # nor any other class of this config: the table serves
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


MAX_COUNT = 1 << 16  # a config's count (layers, blocks, experts, …) beyond this is no model's: none is made
MAX_NESTING = 8  # sub-configs nested deeper than this are no model's
MAX_PARTS = 16_384  # modules, parameters and buffers a model made here may register (see above)

_COUNT_KEY = re.compile(r"layer|block|depth|expert|stage|repeat|cycle|loop|group|head", re.IGNORECASE)
_WIDTH_KEY = re.compile(r"size|dim|vocab|channel|rope|theta", re.IGNORECASE)  # widths, rotary bases: nothing on meta


def _oversized(value, depth: int = 0, counted: bool = False) -> bool:
    """Whether a config (read from the checkpoint: crafted, perhaps) asks, anywhere in it, for a
    count larger than any model's (`counted`: `value` is held by a key naming a count), a list longer
    than any model's, or nests deeper."""
    if depth > MAX_NESTING:
        return True
    if isinstance(value, dict):
        return any(_oversized(v, depth + 1, _is_count(str(k))) for k, v in value.items())
    if isinstance(value, list):
        return len(value) > MAX_COUNT or any(_oversized(v, depth + 1, counted) for v in value)
    if isinstance(value, int) and not isinstance(value, bool):  # (a float is no count: range() takes none)
        return counted and value > MAX_COUNT
    return False


def _is_count(key: str) -> bool:
    return bool(_COUNT_KEY.search(key)) and not _WIDTH_KEY.search(key)


class _TooLarge(BaseException):
    """A model being made registers more than MAX_PARTS parts (a BaseException: no `except
    Exception` of the model's code between takes it for a failure of its own and goes on)."""


def _no_init():
    """transformers' own switch that skips drawing initial weights, as `from_pretrained` does (on
    meta, through torch's reference code: ~3 ms a weight, 9 tenths of making a GPT-2), where this
    transformers has it."""
    try:
        from transformers.initialization import no_init_weights
    except ImportError:
        return contextlib.nullcontext()
    return no_init_weights()


@contextlib.contextmanager
def _bounded_parts(limit: int):
    """Every module, parameter and buffer torch registers meanwhile (in any module, by any code)
    counted; the one past `limit` raises _TooLarge, and so does every one after it."""
    from torch.nn.modules import module as nn_module

    made = 0

    def count(*_registered) -> None:
        nonlocal made
        made += 1
        if made > limit:
            raise _TooLarge

    handles = [nn_module.register_module_module_registration_hook(count),
               nn_module.register_module_parameter_registration_hook(count),
               nn_module.register_module_buffer_registration_hook(count)]
    try:
        yield
    finally:
        for handle in handles:
            handle.remove()


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
