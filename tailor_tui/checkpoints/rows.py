"""Rows: the blocks of a model that a recipe picks a source for, found from its own structure.

A model's rows come from all of its parameter and buffer names at once (`RowNaming`):

- a **block list** is a numbered list of modules that hold modules themselves, found wherever it
  stands: `model.layers.N.…` (Llama, Mixtral, Qwen2-MoE, GPT-NeoX's `gpt_neox.layers`), `model.decoder.layers`
  (OPT), `transformer.h` (GPT-2), `bert.encoder.layer` (BERT), `encoder.block` and `decoder.block`
  (T5). Each entry is a row, with every parameter it holds: its submodules' and its own (a
  layer-scale factor `encoder.layer.N.lambda_1`, `layers.N.scale`);
- every other parameter belongs to the row of the module it sits in beside the block lists
  (embeddings, positional embeddings, final norms, pooler), or to its top-level module (heads);
- a row's name is its module path less the prefix that every block list shares: `layers.3`,
  `embed_tokens`, `norm`, `lm_head` (Llama), `h.0`, `wte` (GPT-2), `layer.2`, `embeddings`, `cls`
  (BERT), `encoder.block.1`, `decoder.block.0`, `encoder.final_layer_norm`, `shared` (T5);
- a PEFT model's names (`base_model.model.model.layers.0.self_attn.q_proj.lora_A.default.weight`)
  are read without PEFT's prefix, and what PEFT puts inside a module it adapts (`PEFT_PARTS`: LoRA's
  layers, the wrapped original, modules_to_save's copies) as a tensor of that module: its LoRA and
  `modules_to_save` parameters are in the row of the module they adapt, and the rows are the plain
  model's, named as its (a numbered Sequential that LoRA adapts, Qwen2-VL's `visual.merger.mlp.0`,
  is no more a block list than in the plain model).

Stacks: a multimodal model holds its block lists in modules of their own, one per stack
(`model.vision_tower.encoder.layers`, `model.language_model.layers`; Qwen2-VL's `model.visual.blocks`).
When a stack's module is named for a modality (`MODALITIES`: vision, audio), the model's rows are
named per stack, each less its own stack's container, the modality's stack prefixed by its name:
`vision.embeddings`, `vision.layers.3`, `vision.post_layernorm`; the one other stack (the language
model) is named as a plain language model is: `embed_tokens`, `layers.12`, `norm` (several others,
as BLIP-2's Q-Former beside its language model: each prefixed by its module's name); rows outside
every stack keep their module's name (`multi_modal_projector`, `lm_head`). Each row's `group` is its
stack's (`vision`, `language`); a row outside the stacks is in the group of the row before it (a
projector after its vision tower, a head after its language model). A model whose stacks are no
modality's (T5's `encoder.block` and `decoder.block`), or whose names per stack would clash, is named
as above, with no groups. Any row is also found by its module path or an unambiguous end of it
(`find_row`): a recipe naming `model.vision_tower.encoder.layers.3` or `vision_tower.encoder.layers.3`
picks `vision.layers.3`.

Tied weights: a name the model's state dict holds that is no parameter of its own (DeepSpeed's
`shared_params`: `lm_head.weight` -> `model.embed_tokens.weight`) is an alias. A row made only of
aliases has no weights of its own and follows the row it is tied to; an alias inside a row with
weights of its own (BERT's `cls.predictions.decoder.weight`) stays with its partner's row.
"""

from __future__ import annotations

import functools
import re
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Iterable

PEFT_PREFIX = "base_model.model."  # how PEFT's PeftModel names the wrapped model's parameters
# the modules PEFT puts inside a module it adapts: LoRA's (peft's LoraLayer.adapter_layer_names), the
# adapted original (`base_layer`), and a modules_to_save wrapper's original and copies
PEFT_PARTS = frozenset({"lora_A", "lora_B", "lora_embedding_A", "lora_embedding_B", "lora_magnitude_vector",
                        "base_layer", "original_module", "modules_to_save"})
CONTAINERS = ("model", "transformer", "gpt_neox", "backbone", "decoder")  # a model without block lists
# a stack's modality, by the words its module's name holds (`vision_tower`, `visual`, `audio_tower`)
MODALITIES = (("vision", ("vision", "visual", "image", "img")), ("audio", ("audio", "speech", "sound")))
LANGUAGE = "language"  # the group of the one stack of no modality (a multimodal model's language model)


@dataclass(frozen=True)
class Row:
    """A block of the model and the parameters and buffers it owns."""

    name: str  # `layers.3`
    module_path: str  # `model.layers.3` (`base_model.model.model.layers.3` in a PEFT model)
    params: tuple[str, ...]  # trainable and frozen parameter names
    buffers: tuple[str, ...]
    aliases: tuple[tuple[str, str], ...] = ()  # (name in the state dict, the parameter it is tied to)
    group: str = ""  # its stack in a multimodal model (`vision`, `language`); "" in a model of one

    @property
    def tied(self) -> bool:
        """True when the row has no storage of its own (e.g. lm_head tied to embeddings)."""
        return not self.params and not self.buffers


def _first_index(parts: list[str]) -> int | None:
    """Where the first entry of a block list stands in a name's parts: a number after at least
    one part, followed by at least a submodule and a tensor name (`layers.3.mlp.weight`)."""
    for i in range(1, len(parts) - 2):
        if parts[i].isdigit():
            return i
    return None


def _common(paths: Iterable[tuple[str, ...]]) -> tuple[str, ...]:
    paths = list(paths)
    if not paths:
        return ()
    first = paths[0]
    n = len(first)
    for p in paths[1:]:
        n = min(n, len(p))
        for i in range(n):
            if p[i] != first[i]:
                n = i
                break
    return first[:n]


def modality(module: str) -> str | None:
    """The modality a stack's module is named for (`vision_tower`: vision), or None."""
    low = module.lower()
    return next((name for name, words in MODALITIES if any(w in low for w in words)), None)


@dataclass(frozen=True)
class Stack:
    """One stack of a multimodal model: the module holding some of its block lists."""

    path: tuple[str, ...]  # `("model", "vision_tower")`
    container: tuple[str, ...]  # what its rows are named less: its block lists' parents' common part
    prefix: str  # `vision.` (the language model's: "")
    group: str  # `vision`, `language`


class RowNaming:
    """The row of every name of one model (parameters, buffers, aliases, and the tensor names
    of its weight files), from all of its parameter and buffer names."""

    def __init__(self, names: Iterable[str]):
        names = list(names)
        self.prefix = PEFT_PREFIX if names and all(n.startswith(PEFT_PREFIX) for n in names) else ""
        lists = set()
        for name in names:
            parts = self._parts(name)
            i = _first_index(parts)
            if i is not None:
                lists.add(tuple(parts[:i]))
        self.parents = sorted({lst[:-1] for lst in lists}, key=len, reverse=True)
        self.lists = lists
        self.container = _common(self.parents) if lists else None
        self.stacks = self._stacks()
        if self.stacks and not self._distinct(names):
            self.stacks = ()

    def _stacks(self) -> tuple[Stack, ...]:
        """The model's stacks, when some are a modality's (each of another); else ()."""
        if self.container is None:
            return ()
        depth = len(self.container)
        keys = sorted({p[depth] for p in self.parents if len(p) > depth})
        if len(keys) < 2 or any(len(p) <= depth for p in self.parents):
            return ()
        kinds = {key: modality(key) for key in keys}
        found = [k for k in kinds.values() if k]
        plain = [key for key, kind in kinds.items() if kind is None]
        if not found or len(set(found)) != len(found):
            return ()
        stacks = []
        for key, kind in kinds.items():
            path = (*self.container, key)
            container = _common(p for p in self.parents if p[: depth + 1] == path)
            name = kind or (LANGUAGE if len(plain) == 1 else key)  # several others: each by its module
            stacks.append(Stack(path, container, "" if name == LANGUAGE else f"{name}.", name))
        return tuple(stacks)

    def _distinct(self, names: list[str]) -> bool:
        """Whether the names per stack tell every row apart (one module path per row name)."""
        seen: dict[str, str] = {}
        for name in names:
            row, path = self.split(name)
            if seen.setdefault(row, path) != path:
                return False
        return True

    def stack_of(self, parts: list[str]) -> Stack | None:
        return next((s for s in self.stacks if tuple(parts[: len(s.path)]) == s.path), None)

    def split(self, name: str) -> tuple[str, str]:
        """(row name, module path of the row) of a parameter, buffer or weight-file tensor name."""
        parts = self._parts(name)
        if self.container is None:  # no block list: the top-level module (under a container)
            if len(parts) > 2 and parts[0] in CONTAINERS:
                return parts[1], self._path(parts[:2])
            take = 2 if len(parts) > 2 and parts[1].isdigit() else 1
            return ".".join(parts[:take]), self._path(parts[:take])
        i = self._entry(parts)
        if i is not None:
            module = parts[: i + 1]
        else:
            shared = max((len(_common([tuple(parts[:-1]), p])) for p in self.parents), default=0)
            module = parts[: shared + 1]
        stack = self.stack_of(parts)
        container, prefix = (stack.container, stack.prefix) if stack else (self.container, "")
        row = module[len(_common([tuple(module), container])):]
        return prefix + ".".join(row or module), self._path(module)

    def group(self, name: str) -> str:
        """The group of a name's row: its stack's, "" outside the stacks (or with none)."""
        stack = self.stack_of(self._parts(name))
        return stack.group if stack else ""

    def _parts(self, name: str) -> list[str]:
        """A name's parts as the plain model's: a PEFT model's less PEFT's prefix, and cut after the first
        of PEFT's modules in the module it adapts (`mlp.0.lora_A.default.weight`: `mlp.0.lora_A`, a tensor
        of `mlp.0`)."""
        if not (self.prefix and name.startswith(self.prefix)):
            return name.split(".")
        parts = name[len(self.prefix):].split(".")
        cut = next((i for i, part in enumerate(parts) if part in PEFT_PARTS), len(parts))
        return parts[: cut + 1]

    def _entry(self, parts: list[str]) -> int | None:
        """Where the number of an entry of one of the block lists stands in a name's parts: a block's
        submodules (`layers.3.mlp.weight`) and the parameters it holds itself (`layers.3.scale`, a
        layer-scale factor `encoder.layer.3.lambda_1`) are the block's."""
        for i in range(1, len(parts) - 1):
            if parts[i].isdigit() and tuple(parts[:i]) in self.lists:
                return i
        return None

    def _path(self, parts: list[str]) -> str:
        return self.prefix + ".".join(parts)

    def row_of(self, name: str) -> str:
        return self.split(name)[0]


def model_rows(params: Iterable[str], buffers: Iterable[str] = (), aliases: dict[str, str] | None = None,
               order: Iterable[str] = ()) -> tuple[Row, ...]:
    """The rows of a model, in `order` (the state dict's), then any parameter not listed there.
    `aliases`: state-dict names tied to a parameter (DeepSpeed's `shared_params`)."""
    params, buffers, aliases = list(params), list(buffers), dict(aliases or {})
    naming = RowNaming([*params, *buffers])
    is_param, is_buffer = set(params), set(buffers)
    names = list(dict.fromkeys([*order, *params, *buffers, *aliases]))
    owned: dict[str, tuple[str, list[str], list[str], list[tuple[str, str]]]] = {}
    groups: dict[str, str] = {}
    for name in names:
        row, module_path = naming.split(name)
        entry = owned.setdefault(row, (module_path, [], [], []))
        groups.setdefault(row, naming.group(name))
        if name in is_param:
            entry[1].append(name)
        elif name in is_buffer:
            entry[2].append(name)
        elif name in aliases:
            entry[3].append((name, aliases[name]))
    rows = [Row(r, mp, tuple(p), tuple(b), tuple(a), groups[r]) for r, (mp, p, b, a) in owned.items()]
    return _grouped(_shared_blocks(tuple(r for r in rows if r.params or r.buffers or r.aliases)))


def _shared_blocks(rows: tuple[Row, ...]) -> tuple[Row, ...]:
    """Each module one row holds that other rows run too (its names there aliases of its parameters, at the same
    place in them: Zamba2's `layers.3.shared_transformer.…` tied to `layers.1.shared_transformer.…`) taken out of
    it as a row of its own, named for it (`layers.1.shared_transformer`) and placed after it, with its aliases in
    every row running it: picking it moves the block for every layer that runs it, picking a layer never does."""
    by_name = {r.name: r for r in rows}
    owner = {n: r.name for r in rows for n in (*r.params, *r.buffers)}
    shared: dict[str, tuple[str, str]] = {}  # the shared module's path -> (its row, its path less the row's)
    for row in rows:
        mirrored: dict[str, dict[str, None]] = {}  # a holder's name -> the names of its this row runs (less its path)
        for alias, target in row.aliases:
            holder = by_name.get(owner.get(target, ""))
            if holder is None or holder.name == row.name or not alias.startswith(row.module_path + "."):
                continue
            rel = alias[len(row.module_path) + 1:]
            if target != f"{holder.module_path}.{rel}":
                continue  # tied elsewhere than at the same place (an lm_head to an embedding): followed as today
            mirrored.setdefault(holder.name, {})[rel] = None
        for name, runs in mirrored.items():
            holder = by_name[name]
            held = [n[len(holder.module_path) + 1:] for n in (*holder.params, *holder.buffers)]
            for rel in runs:
                if any(f"{holder.module_path}.{rel}".startswith(p + ".") for p in shared):
                    continue  # in a block found already
                parts = rel.split(".")
                for k in range(1, len(parts)):  # the largest module of the holder every name of which this row runs
                    module = ".".join(parts[:k])
                    inside = [n for n in held if n.startswith(module + ".")]
                    if inside and all(n in runs for n in inside):
                        path = f"{holder.module_path}.{module}"
                        if not any(path.startswith(p + ".") for p in shared):  # (within a block found already)
                            shared = {p: v for p, v in shared.items() if not p.startswith(path + ".")}
                            shared.setdefault(path, (holder.name, module))
                        break
    if not shared:
        return rows
    blocks: dict[str, list[Row]] = {}  # a holder's name -> the rows of the blocks taken out of it
    for path, (name, rel) in shared.items():
        holder = by_name[name]
        blocks.setdefault(name, []).append(Row(
            f"{name}.{rel}", path, tuple(n for n in holder.params if n.startswith(path + ".")),
            tuple(n for n in holder.buffers if n.startswith(path + ".")),
            tuple((a, t) for r in rows for a, t in r.aliases if t.startswith(path + ".")), holder.group))
    moved = {n for found in blocks.values() for b in found for n in (*b.params, *b.buffers)}
    running = {a for found in blocks.values() for b in found for a, _t in b.aliases}  # the blocks' names elsewhere
    out: list[Row] = []
    for row in rows:
        kept = replace(row, params=tuple(n for n in row.params if n not in moved),
                       buffers=tuple(n for n in row.buffers if n not in moved),
                       aliases=tuple((a, t) for a, t in row.aliases if a not in running))
        if kept.params or kept.buffers or kept.aliases:
            out.append(kept)
        out += blocks.get(row.name, [])
    return tuple(out)


def _grouped(rows: tuple[Row, ...]) -> tuple[Row, ...]:
    """A row outside the stacks joins the group of the row before it (the first rows: after them)."""
    if not any(r.group for r in rows):
        return rows
    first = next(r.group for r in rows if r.group)
    out, last = [], first
    for r in rows:
        last = r.group or last
        out.append(r if r.group else replace(r, group=last))
    return tuple(out)


def find_row(rows: Iterable[Row], key: str) -> Row | None:
    """The row a recipe means by `key`: its name, its module path, or the one row whose module path
    (less PEFT's prefix) ends with `key` after a dot (`vision_tower.encoder.layers.3`); None if none
    or several."""
    rows = list(rows)
    for row in rows:
        if key in (row.name, row.module_path):
            return row
    ends = [r for r in rows if ("." + r.module_path.removeprefix(PEFT_PREFIX)).endswith("." + key)]
    return ends[0] if len(ends) == 1 else None


def recipe_row(rows: tuple[Row, ...], name: str, where: str, holder: str) -> Row:
    """The row a recipe's `name` means among `rows` (of checkpoint `holder`, by its folder's name; `find_row`), or
    one line naming it, the closest row name and every row (RecipeError): the composer's ctrl+o and --apply say
    the same, of any kind of checkpoint."""
    import difflib

    from tailor_tui.errors import RecipeError

    row = find_row(rows, name)
    if row is not None:
        return row
    names = [r.name for r in rows]
    close = difflib.get_close_matches(name, names, n=1)
    hint = f"did you mean '{close[0]}'? " if close else ""
    raise RecipeError(f"{where}: unknown row '{name}'; {hint}{holder} has rows {list_rows(names)}")


class RowsByName:
    """A checkpoint's rows (`rows`, its folder `path`), looked up as recipes and the composer name them: the one rule
    for every kind of checkpoint."""

    rows: tuple[Row, ...]
    path: Path

    def row(self, name: str) -> Row:
        """The row `name` means: its name, module path or an unambiguous end of it (`find_row`)."""
        row = find_row(self.rows, name)
        if row is None:
            raise KeyError(name)
        return row

    def recipe_row(self, name: str, where: str) -> Row:
        """The row a recipe's `name` means (`recipe_row`: RecipeError naming the closest where none)."""
        return recipe_row(self.rows, name, where, self.path.name)

    def row_names(self) -> list[str]:
        return [r.name for r in self.rows]


class RowIndex:
    """Which row holds a tensor of the model's weight files, by name: the rows' own names first,
    then the longest row module path the name lies under; an alias follows its partner's row."""

    def __init__(self, rows: Iterable[Row]):
        rows = list(rows)
        self.rows = {r.name: r for r in rows}
        self.owner = {n: r.name for r in rows for n in (*r.params, *r.buffers)}
        self.partner = {alias: target for r in rows for alias, target in r.aliases}
        self.paths = sorted(((r.module_path, r.name) for r in rows), key=lambda p: len(p[0]), reverse=True)

    def row_of(self, name: str) -> str | None:
        """The row whose weights `name` holds (a tied row's partner's), or None if no row has it."""
        if name in self.owner:
            return self.owner[name]
        if name in self.partner and self.partner[name] in self.owner:
            return self.owner[self.partner[name]]
        for path, row in self.paths:
            if name.startswith(path + ".") and not self.rows[row].tied:
                return row
        return None

    def tied_to(self, row: str) -> str | None:
        """The row a storage-less row follows (its first alias's partner's row), or None."""
        for _alias, target in self.rows[row].aliases:
            if target in self.owner:
                return self.owner[target]
        return None


@functools.lru_cache(maxsize=16)
def row_index(rows: tuple[Row, ...]) -> RowIndex:
    """The RowIndex of a checkpoint's rows, built once per set of rows."""
    return RowIndex(rows)


def list_rows(names: list[str], most: int = 8) -> str:
    """Row names for a message, each once, every run of numbered rows as a range (`layers.0–31`, as the plan
    groups them): every row named, where there are at most `most` such parts (a suggestion made beside it is
    always in it); else the first few, an ellipsis, the last."""
    parts: list[list] = []  # [prefix, first, last] of a run of numbered rows, or [name]
    for name in dict.fromkeys(names):
        found = re.fullmatch(r"(.*\.)(\d{1,9})", name)
        last = parts[-1] if parts else None
        if found and last is not None and len(last) == 3 and last[0] == found[1] and last[2] + 1 == int(found[2]):
            last[2] = int(found[2])
        else:
            parts.append([found[1], int(found[2]), int(found[2])] if found else [name])
    text = [p[0] if len(p) == 1 else f"{p[0]}{p[1]}" + (f"–{p[2]}" if p[2] > p[1] else "") for p in parts]
    if len(text) <= most + 1:
        return ", ".join(text)
    return f"{', '.join(text[:most])}, …, {text[-1]}"
