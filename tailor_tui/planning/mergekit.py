"""LLMTailor's recipes (mergekit's YAML, `merge_method: passthrough`) read as they are written.

    slices:
      - sources: [{model: /runs/llama/checkpoint-1, layer_range: [0, 0]}]    # magic: norm
      - sources: [{model: /runs/llama/checkpoint-1, layer_range: [0, 16]}]   # layers.0 .. layers.15
      - sources: [{model: /runs/llama/checkpoint-2, layer_range: [16, 32]}]  # layers.16 .. layers.31
      - sources: [{model: /runs/llama/checkpoint-2, layer_range: [33, 33]}]  # magic: lm_head
      - sources: [{model: /runs/llama/checkpoint-1, layer_range: [34, 34]}]  # magic: embed_tokens
    pre_weights:  [{name: model.norm.weight, model: /runs/llama/checkpoint-1}]
    post_weights: [{name: lm_head.weight, model: /runs/llama/checkpoint-2},
                   {name: model.embed_tokens.weight, model: /runs/llama/checkpoint-1}]
    merge_method: passthrough
    dtype: bfloat16

What each part means is what LLMTailor's code (github.com/SunMinqiu/LLMTailor) does with it; this
module reads the file's shape (`parse`) and gives every row its source (`row_sources`), refusing in one
line what tailor-tui cannot compose as LLMTailor would. `mergekit_recipe` resolves its model paths and
makes it a tailor-tui `Recipe`.

- A slice's `layer_range: [a, b]` is half-open: layers a .. b-1 (mergekit's `plan_slice` plans
  `range(b - a)` layers from `a`, llmtailor/plan.py:273-298). Passthrough stacks slices in their order
  (merge.py:358-373 counts the output's layers on from the previous slice's end), so the slices must
  list every layer once, in order, each where the one before ended: then layer i comes from layer i.
- A zero-length slice plans no model weight (range(0)); LLMTailor's optimizer merge reads three of
  them as optimizer param groups of its training script's layout (examples/trainLLM.py:170-237: one
  group per layer and weight decay, names before layer numbers): [0, 0] is group 0, `model.norm.weight`;
  [L+1, L+1] is group L+1, `lm_head.weight`, and [L+2, L+2] group L+2, `model.embed_tokens.weight`,
  for a model of L layers (merge.py:535-548). With tied embeddings only [L+1, L+1] is read, and its
  group is `model.embed_tokens.weight` (merge.py:446-454). create_yaml.py:28-38 writes them so, and
  writes the same checkpoints into pre_weights/post_weights (create_yaml.py:71-88).
- `pre_weights` / `post_weights` (`{name, model}`) give those rows' model-file weights (plan.py:336-392);
  a file without the key takes mergekit's default: the first slice's model for pre_weights
  (embed_tokens), the last slice's for post_weights (norm, lm_head) (plan.py:354-361, 385-392).

tailor-tui takes a row whole (weights, fp32 master, Adam moments) from one checkpoint, so a magic slice
and the pre_weights/post_weights entry of the same row must name the same checkpoint.
"""

from __future__ import annotations

from dataclasses import dataclass

import yaml

from tailor_tui.errors import RecipeError
from tailor_tui.planning.recipe import recipe_int

KEYS = ("slices", "merge_method", "pre_weights", "post_weights", "dtype", "out_dtype")
# mergekit keys that say something tailor-tui does not do, and what to do instead
REFUSED = {
    "models": "mixes whole models; tailor-tui composes rows: list them under `slices`",
    "modules": "merges modules separately; tailor-tui composes one model's rows: list them under `slices`",
    "base_model": "names a base to mix against; passthrough mixes nothing: remove it",
    "parameters": "sets mixing weights; passthrough takes each row whole: remove it",
    "tokenizer_source": "builds a tokenizer (and may resize the embeddings); tailor-tui keeps the run's: remove it",
    "tokenizer": "builds a tokenizer (and may resize the embeddings); tailor-tui keeps the run's: remove it",
    "chat_template": "sets a chat template; tailor-tui keeps the run's tokenizer files: remove it",
}
# the model-file names LLMTailor's pre_weights/post_weights give (create_yaml.py:72-84), and their rows
WEIGHT_ROWS = {"model.embed_tokens.weight": "embed_tokens", "model.norm.weight": "norm", "lm_head.weight": "lm_head"}
DTYPES = {"bfloat16": "bf16", "bf16": "bf16", "float16": "fp16", "fp16": "fp16", "half": "fp16",
          "float32": "fp32", "fp32": "fp32", "float": "fp32"}
SEQ, MAP, STR = yaml.SequenceNode, yaml.MappingNode, "tag:yaml.org,2002:str"


@dataclass(frozen=True)
class ModelRef:
    """A `model:` as written, where, and what holds it (`slices[2]`, `post_weights[0]`)."""

    model: str
    at: str
    what: str


@dataclass(frozen=True)
class Slice:
    start: int
    end: int
    source: ModelRef
    at: str  # its layer_range's place

    @property
    def magic(self) -> bool:
        return self.start == self.end


@dataclass(frozen=True)
class Weight:
    row: str
    source: ModelRef


@dataclass(frozen=True)
class LLMTailorRecipe:
    slices: tuple[Slice, ...]
    pre_weights: tuple[Weight, ...] | None  # None: the key is absent (mergekit's default applies)
    post_weights: tuple[Weight, ...] | None
    dtype: tuple[str, str, str] | None  # (as written, tailor-tui's name, where), when `dtype`/`out_dtype` is given
    source: str

    def layers(self) -> int:
        """The layers the slices cover (the end of the last one that is not empty)."""
        return max((s.end for s in self.slices if not s.magic), default=0)


def looks_like(text: str) -> bool:
    """Whether recipe text is mergekit's (its keys say so) rather than tailor-tui's."""
    try:
        root = yaml.compose(text, Loader=yaml.SafeLoader)
    except (yaml.YAMLError, RecursionError):
        return False
    keys = {k.value for k, _ in root.value if isinstance(k, yaml.ScalarNode)} if isinstance(root, MAP) else set()
    return "version" not in keys and bool(keys & {"slices", "merge_method", "models", "modules"})


def _at(source: str, node: yaml.Node) -> str:
    return f"{source}:{node.start_mark.line + 1}:{node.start_mark.column + 1}"


def _mapping(node: yaml.Node, source: str, what: str, keys: tuple[str, ...],
             refused: dict[str, str]) -> dict[str, yaml.Node]:
    if not isinstance(node, MAP):
        raise RecipeError(f"{_at(source, node)}: {what} must be a mapping with keys {', '.join(keys)}")
    found: dict[str, yaml.Node] = {}
    for key, value in node.value:
        name = key.value if isinstance(key, yaml.ScalarNode) else "?"
        if name in refused:
            raise RecipeError(f"{_at(source, key)}: {what}: `{name}` {refused[name]}")
        if name not in keys:
            raise RecipeError(f"{_at(source, key)}: {what}: unknown key '{name}'; it has only {', '.join(keys)}")
        if name in found:
            raise RecipeError(f"{_at(source, key)}: {what}: key '{name}' is given twice")
        found[name] = value
    return found


def _text(node: yaml.Node, source: str, what: str) -> str:
    if not isinstance(node, yaml.ScalarNode) or node.tag != STR or not node.value:
        raise RecipeError(f"{_at(source, node)}: {what} must be text")
    return node.value


def _items(node: yaml.Node, source: str, what: str) -> list[yaml.Node]:
    if not isinstance(node, SEQ) or not node.value:
        raise RecipeError(f"{_at(source, node)}: `{what}` must be a list of at least one entry")
    return node.value


def _slice(node: yaml.Node, i: int, source: str) -> Slice:
    what = f"slices[{i}]"
    refused = {"base_model": REFUSED["base_model"], "parameters": REFUSED["parameters"],
               "residual_weight": "mixes in a residual; passthrough takes each layer whole: remove it"}
    sources = _mapping(node, source, what, ("sources",), refused).get("sources")
    if sources is None:
        raise RecipeError(f"{_at(source, node)}: {what} has no `sources`")
    items = _items(sources, source, f"{what}.sources")
    if len(items) > 1:
        raise RecipeError(f"{_at(source, items[1])}: {what}.sources has {len(items)} sources; tailor-tui takes each "
                          f"layer whole from one checkpoint (passthrough): keep one source per slice")
    src = _mapping(items[0], source, f"{what}.sources[0]", ("model", "layer_range"),
                   {"parameters": REFUSED["parameters"]})
    for key in ("model", "layer_range"):
        if key not in src:
            raise RecipeError(f"{_at(source, items[0])}: {what}.sources[0] has no `{key}`")
    model = ModelRef(_text(src["model"], source, f"{what}: `model`"), _at(source, src["model"]), what)
    lr = src["layer_range"]
    must = (f"{what}: `layer_range` must be [first, end]: two whole numbers "
            "(half-open: layers first .. end-1)")
    if not (isinstance(lr, SEQ) and len(lr.value) == 2):
        raise RecipeError(f"{_at(source, lr)}: {must}")
    start, end = (recipe_int(n, source, must) for n in lr.value)
    if end < start:
        raise RecipeError(f"{_at(source, lr)}: {what}: layer_range [{start}, {end}] ends before it starts")
    return Slice(start, end, model, _at(source, lr))


def _weights(node: yaml.Node, key: str, source: str) -> tuple[Weight, ...]:
    out = []
    for i, item in enumerate(_items(node, source, key)):
        what = f"{key}[{i}]"
        fields = _mapping(item, source, what, ("name", "model"), {})
        for k in ("name", "model"):
            if k not in fields:
                raise RecipeError(f"{_at(source, item)}: {what} has no `{k}`")
        name = _text(fields["name"], source, f"{what}: `name`")
        if name not in WEIGHT_ROWS:
            raise RecipeError(f"{_at(source, fields['name'])}: {what}: '{name}' is none of the weights LLMTailor's "
                              f"{key} name ({', '.join(WEIGHT_ROWS)}); a layer's weights come from `slices`")
        model = ModelRef(_text(fields["model"], source, f"{what}: `model`"), _at(source, fields["model"]),
                       f"{what} ({name})")
        out.append(Weight(WEIGHT_ROWS[name], model))
    return tuple(out)


def parse(text: str, source: str) -> LLMTailorRecipe:
    """The recipe's shape, checked: RecipeError names the first problem as `file:line:col: ...`."""
    root = yaml.compose(text, Loader=yaml.SafeLoader)
    nodes = _mapping(root, source, "an LLMTailor recipe", KEYS, REFUSED)
    method = nodes.get("merge_method")
    if method is None:
        raise RecipeError(f"{source}: no `merge_method`; tailor-tui reads LLMTailor recipes of `merge_method: "
                          "passthrough`")
    if not (isinstance(method, yaml.ScalarNode) and method.value == "passthrough"):
        raise RecipeError(f"{_at(source, method)}: merge_method '{getattr(method, 'value', '?')}' mixes weights; "
                          "tailor-tui takes each row whole from one checkpoint: use `merge_method: passthrough`")
    if "slices" not in nodes:
        raise RecipeError(f"{source}: no `slices`; list the layers' sources under `slices`")
    slices = tuple(_slice(n, i, source) for i, n in enumerate(_items(nodes["slices"], source, "slices")))
    dtype = None
    for key in ("dtype", "out_dtype"):
        if key in nodes:
            value = _text(nodes[key], source, f"`{key}`")
            if value not in DTYPES:
                raise RecipeError(f"{_at(source, nodes[key])}: {key} '{value}' is none of {', '.join(DTYPES)}")
            if dtype is not None and DTYPES[value] != dtype[1]:
                raise RecipeError(f"{_at(source, nodes[key])}: {key} '{value}' differs from `dtype`; tailor-tui "
                                  "keeps the training dtype: remove one")
            dtype = (value, DTYPES[value], _at(source, nodes[key]))
    pre = _weights(nodes["pre_weights"], "pre_weights", source) if "pre_weights" in nodes else None
    post = _weights(nodes["post_weights"], "post_weights", source) if "post_weights" in nodes else None
    return LLMTailorRecipe(slices, pre, post, dtype, source)


def _magic_rows(layers: int, tied: bool) -> dict[int, str]:
    """What each zero-length slice LLMTailor reads stands for (merge.py:446-454, 535-548)."""
    if tied:
        return {0: "norm", layers + 1: "embed_tokens"}
    return {0: "norm", layers + 1: "lm_head", layers + 2: "embed_tokens"}


def row_sources(recipe: LLMTailorRecipe, layers: int, tied: bool = False) -> dict[str, list[ModelRef]]:
    """Every row's sources, as written (the layers', then norm's, lm_head's, embed_tokens'), for a model of
    `layers` layers (lm_head tied to embed_tokens: `tied`); each row's sources must then name one checkpoint.
    RecipeError for a layer given twice or not at all, out of order, or a zero-length slice of no row."""
    rows: dict[str, list[ModelRef]] = {}
    done = 0  # the layers before it: slices stack in their order (merge.py:358-373)
    magic = _magic_rows(layers, tied)
    for s in recipe.slices:
        where = f"{s.at}: {s.source.what}: layer_range [{s.start}, {s.end}]"
        if s.magic:
            if s.start not in magic:
                stands = ", ".join(f"[{i}, {i}] {row}" for i, row in magic.items())
                raise RecipeError(f"{where} is empty and none of LLMTailor's magic slices for a model of {layers} "
                                  f"layers ({stands}); remove it")
            row = magic[s.start]
            if row in rows:
                raise RecipeError(f"{where} is the second slice for {row}; keep one")
            rows[row] = [s.source]
            continue
        if s.start > done:
            raise RecipeError(f"{where} leaves layers {done}..{s.start - 1} out; every layer needs a slice "
                              f"(half-open: [{done}, {s.start}] gives them)")
        if s.start < done:
            raise RecipeError(f"{where} overlaps the slices before it (they end at {done}); passthrough would stack "
                              f"layers {s.start}..{min(done, s.end) - 1} twice: give every layer once, in order")
        if s.end > layers:
            raise RecipeError(f"{where} reaches past the model's {layers} layers (0..{layers - 1})")
        for i in range(s.start, s.end):
            rows[f"layers.{i}"] = [s.source]
        done = s.end
    if done < layers:
        raise RecipeError(f"{recipe.source}: layers {done}..{layers - 1} of the model's {layers} are in no slice; "
                          f"add a slice with layer_range [{done}, {layers}]")
    _weight_sources(recipe, rows, layers, tied)
    return rows


def _weight_sources(recipe: LLMTailorRecipe, rows: dict[str, list[ModelRef]], layers: int, tied: bool) -> None:
    """Add the model-file weights' sources: pre_weights/post_weights, or mergekit's default without them."""
    first = recipe.slices[0].source
    last = recipe.slices[-1].source
    defaults = {"pre_weights": [Weight("embed_tokens", ModelRef(first.model, first.at, f"{first.what} (mergekit's "
                                                              "default for embed_tokens without pre_weights)"))],
                "post_weights": [Weight(r, ModelRef(last.model, last.at, f"{last.what} (mergekit's default for "
                                                  f"{r} without post_weights)")) for r in ("norm", "lm_head")]}
    given: dict[str, ModelRef] = {}  # a weight's name (its row, untied) -> the entry that gives it
    for key, weights in (("pre_weights", recipe.pre_weights), ("post_weights", recipe.post_weights)):
        for w in defaults[key] if weights is None else weights:
            if w.row in given:
                raise RecipeError(f"{w.source.at}: {w.source.what} gives {w.row} again ({given[w.row].what} did, "
                                  f"at {given[w.row].at}); keep one")
            given[w.row] = w.source
            if tied and w.row == "lm_head" and weights is None:
                continue  # mergekit's tied lm_head is no weight of its own
            rows.setdefault("embed_tokens" if tied and w.row == "lm_head" else w.row, []).append(w.source)
    for row, (weight, index) in {"norm": ("model.norm.weight", 0), "lm_head": ("lm_head.weight", layers + 1),
                                 "embed_tokens": ("model.embed_tokens.weight", layers + (1 if tied else 2))}.items():
        if row not in rows and not (tied and row == "lm_head"):
            key = "pre_weights" if row == "embed_tokens" else "post_weights"
            raise RecipeError(f"{recipe.source}: {row} has no source; add `{{name: {weight}, model: ...}}` to {key} "
                              f"(its weights) and the slice [{index}, {index}] (its optimizer state)")
