"""Hostile inputs, one case each, built on a copy of a real run (an HF Trainer run of the
`hf_bf16_2` spec: checkpoint-2, -4 and -6, 2 ranks, bf16). Shared by tests/test_refusals.py
and bench/bench_refusals.py; imports neither pytest nor torch.

A case is a builder `(run, tmp) -> Case`: it changes the copy `run` (never a source) and files
under `tmp`, and says the command line that meets the hostile input and what it must answer:
one `error: ` line and the documented exit code (`code`), or, for inputs that are tolerated
rather than refused (a log or a cache that cannot be read is skipped), its success (`code` 0).
"""

from __future__ import annotations

import json
import os
import struct
import subprocess
import sys
from dataclasses import dataclass, field, replace
from pathlib import Path

RUN_SPEC = "hf_bf16_2"  # the run every case copies (tests/conftest.py RUNS)
OPTIM = "global_step{step}/bf16_zero_pp_rank_{rank}_mp_rank_00_optim_states.pt"
MODEL_STATES = "global_step{step}/zero_pp_rank_{rank}_mp_rank_00_model_states.pt"
MiB = 1 << 20


@dataclass(frozen=True)
class Case:
    args: tuple  # tailor-tui's command line
    code: int  # the exit code it must end with (0: the input is tolerated, not refused)
    needles: tuple = ()  # text the one error line holds (tolerated: text stderr holds)
    env: dict = field(default_factory=dict)


CASES: dict = {}  # name -> builder(run, tmp) -> Case


def case(name: str):
    def register(builder):
        CASES[name] = builder
        return builder

    return register


# --- the hostile forms of a file ----------------------------------------------------------

def fifo(path: Path) -> Path:
    """A FIFO in the file's place: opening it for reading would wait for a writer forever."""
    if os.path.lexists(path):
        path.unlink()
    os.mkfifo(path)
    return path


def dev_zero(path: Path) -> Path:
    """A symbolic link to /dev/zero in the file's place: reading it never ends."""
    if os.path.lexists(path):
        path.unlink()
    path.symlink_to("/dev/zero")
    return path


def huge(path: Path, size: int) -> Path:
    """A sparse file of `size` bytes (no disk used) in the file's place."""
    if os.path.lexists(path):
        path.unlink()
    with open(path, "wb") as f:
        f.truncate(size)
    return path


def deep_json(path: Path, depth: int = 100_000) -> Path:
    if os.path.lexists(path):
        path.unlink()
    path.write_text("[" * depth + "]" * depth)
    return path


def special(form: str, path: Path) -> Path:
    return {"fifo": fifo, "dev-zero": dev_zero}[form](path)


def recipe(tmp: Path, run: Path) -> Path:
    """tmp/recipe.yaml: checkpoint-6, its layers.1 from checkpoint-4, composed into tmp/composed."""
    path = tmp / "recipe.yaml"
    path.write_text(f"version: 1\nbase: {run / 'checkpoint-6'}\noutput: {tmp / 'composed'}\n"
                    f"layers:\n  layers.1: {run / 'checkpoint-4'}\n")
    return path


def dry_run(tmp: Path, run: Path, code: int, *needles: str) -> Case:
    """`--apply --dry-run` of checkpoint-6 with layers.1 from checkpoint-4 (most inputs are read
    to plan, and a dry run writes nothing whatever happens)."""
    return Case(("--apply", recipe(tmp, run), "--dry-run"), code, needles)


# --- the recipe ---------------------------------------------------------------------------

for _form in ("fifo", "dev-zero"):
    @case(f"recipe: {_form}")
    def _(run, tmp, form=_form):
        path = special(form, tmp / "recipe.yaml")
        return Case(("--apply", path, "--dry-run"), 3, ("recipe.yaml", "not a regular file"))


@case("recipe: 2 MiB")
def _(run, tmp):
    return Case(("--apply", huge(tmp / "recipe.yaml", 2 * MiB), "--dry-run"), 3, ("recipe.yaml", "bytes"))


@case("recipe: nested 100,000 deep")
def _(run, tmp):
    path = recipe(tmp, run)
    path.write_text(path.read_text().split("layers:")[0] + "layers: " + "[" * 100_000 + "]" * 100_000 + "\n")
    return Case(("--apply", path, "--dry-run"), 3, ("recipe.yaml", "nested more than"))


@case("recipe: 400,000 values in 800 KB")
def _(run, tmp):
    path = recipe(tmp, run)
    path.write_text(path.read_text().split("layers:")[0] + "layers: [" + "0," * 400_000 + "0]\n")
    return Case(("--apply", path, "--dry-run"), 3, ("recipe.yaml", "YAML values"))


@case("recipe: aliases of aliases")
def _(run, tmp):
    path = recipe(tmp, run)
    lines = ["a0: &a0 [x, x, x, x, x, x, x, x, x, x]"]
    lines += [f"a{i}: &a{i} [{', '.join([f'*a{i - 1}'] * 10)}]" for i in range(1, 12)]
    path.write_text("\n".join(lines) + "\n" + path.read_text())
    return Case(("--apply", path, "--dry-run"), 3, ("recipe.yaml", "unknown key"))


# Whole numbers YAML reads as integers but tailor-tui does not (issue 58): a digit int() refuses
# (`²`, which str.isdigit takes), another script's digits int() reads (`٣`), more digits than int()
# reads (5,000), past 64 bits, an octal YAML 1.1 reads otherwise (`010` is 8)
NUMBERS = {"superscript two": '!!int "\u00b2"', "Arabic-Indic three": '!!int "\u0663"', "5,000 digits": "9" * 5000,
           "2**64": str(1 << 64), "YAML 1.1 octal": "010"}
for _what, _number in NUMBERS.items():
    @case(f"recipe: world_size {_what}")
    def _(run, tmp, number=_number):
        path = recipe(tmp, run)
        path.write_text(path.read_text() + f"world_size: {number}\n")
        return Case(("--apply", path, "--dry-run"), 3, ("recipe.yaml:6:13", "`world_size` must be a whole number",
                                                         "plain decimal digits"))

    @case(f"LLMTailor recipe: layer_range end {_what}")
    def _(run, tmp, number=_number):
        path = tmp / "llmtailor.yaml"
        path.write_text(f"slices:\n  - sources: [{{model: {run / 'checkpoint-4'}, layer_range: [0, {number}]}}]\n"
                        "merge_method: passthrough\n")
        return Case(("--apply", path, "--run", run, "--dry-run"), 3,
                    ("llmtailor.yaml:2:", "`layer_range` must be [first, end]", "plain decimal digits"))


# --- `latest`, the partial-save manifest, the model files' index -------------------------

for _form in ("fifo", "dev-zero"):
    @case(f"latest: {_form}")
    def _(run, tmp, form=_form):
        special(form, run / "checkpoint-6" / "latest")
        return dry_run(tmp, run, 4, "latest", "not a regular file")


@case("latest: 1 MiB")
def _(run, tmp):
    huge(run / "checkpoint-6" / "latest", MiB)
    return dry_run(tmp, run, 4, "latest", "bytes")


for _name, _file in (("manifest", "tailor_partial.json"), ("index", "model.safetensors.index.json")):
    for _form in ("fifo", "dev-zero"):
        @case(f"{_name}: {_form}")
        def _(run, tmp, form=_form, file=_file):
            special(form, run / "checkpoint-4" / file)
            return dry_run(tmp, run, 4, file, "not a regular file")

    @case(f"{_name}: 65 MiB")
    def _(run, tmp, file=_file):
        huge(run / "checkpoint-4" / file, 65 * MiB)
        return dry_run(tmp, run, 4, file, "bytes")

    @case(f"{_name}: nested 100,000 deep")
    def _(run, tmp, file=_file):
        deep_json(run / "checkpoint-4" / file)
        return dry_run(tmp, run, 4, file, "nested")


def shards_in_folders(ckpt: Path, shards: tuple[str, str]) -> None:
    """checkpoint's model.safetensors split by an index between two shards at `shards` (relative
    paths; those inside the checkpoint are made, each a copy of the whole file)."""
    model = ckpt / "model.safetensors"
    with open(model, "rb") as f:
        names = sorted(k for k in json.loads(f.read(struct.unpack("<Q", f.read(8))[0])) if k != "__metadata__")
    for shard in shards:
        target = (ckpt / shard).resolve()
        if target.is_relative_to(ckpt.resolve()):
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_bytes(model.read_bytes())
    model.unlink()
    weight_map = {name: shards[i % 2] for i, name in enumerate(names)}
    (ckpt / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))


@case("index: two shards of one name in different folders")
def _(run, tmp):
    shards_in_folders(run / "checkpoint-6", ("a/model.safetensors", "b/model.safetensors"))
    return dry_run(tmp, run, 4, "2 shards of one name in different folders", "'a/model.safetensors'",
                   "'b/model.safetensors'")


for _shard in ("sub/model-1.safetensors", "../model-1.safetensors", "/tmp/model-1.safetensors"):
    @case(f"index: a shard at {_shard}")
    def _(run, tmp, shard=_shard):
        shards_in_folders(run / "checkpoint-6", ("model-0.safetensors", shard))
        return dry_run(tmp, run, 4, f"shard {shard!r}, not a file beside the index")


# --- config.json (--export), trainer_state.json (--stats), the DeepSpeed config -----------

def export(tmp: Path, run: Path, code: int, *needles: str) -> Case:
    return Case(("--export", recipe(tmp, run), "--to", tmp / "hf"), code, needles)


for _form in ("fifo", "dev-zero"):
    @case(f"config.json: {_form}")
    def _(run, tmp, form=_form):
        special(form, run / "checkpoint-6" / "config.json")
        return export(tmp, run, 4, "config.json", "not a regular file")


@case("config.json: 5 MiB")
def _(run, tmp):
    huge(run / "checkpoint-6" / "config.json", 5 * MiB)
    return export(tmp, run, 2, "config.json", "bytes")


@case("config.json: nested 100,000 deep")
def _(run, tmp):
    deep_json(run / "checkpoint-6" / "config.json")
    return export(tmp, run, 2, "config.json", "nested")


def stats(tmp: Path, run: Path) -> Case:
    return Case(("--stats", run, "--json"), 0, env={"TAILOR_TUI_CACHE": str(tmp / "cache")})


for _form in ("fifo", "dev-zero"):
    @case(f"trainer_state.json: {_form} (skipped)")
    def _(run, tmp, form=_form):
        special(form, run / "checkpoint-4" / "trainer_state.json")
        return stats(tmp, run)


@case("trainer_state.json: 2 GiB (skipped)")
def _(run, tmp):
    huge(run / "checkpoint-4" / "trainer_state.json", 2 << 30)
    return stats(tmp, run)


def log_numbers(run: Path, numbers: dict[int, dict[str, str]]) -> None:
    """Every checkpoint's trainer_state.json alike (one run still) with the log entry at each step
    given holding each field given as that JSON number text (which json.dumps cannot write)."""
    for state in sorted(run.glob("checkpoint-*/trainer_state.json")):
        doc = json.loads(state.read_text())
        for entry in doc["log_history"]:
            for key in numbers.get(entry.get("step"), {}):
                entry[key] = f"@{entry['step']}:{key}@"
        text = json.dumps(doc, indent=2, sort_keys=True)
        for step, fields in numbers.items():
            for key, number in fields.items():
                text = text.replace(f'"@{step}:{key}@"', number)
        state.write_text(text)


@case("trainer_state.json: a 401-digit loss and step (ignored, noted)")
def _(run, tmp):
    log_numbers(run, {2: {"loss": "9" * 401}, 4: {"step": "-" + "9" * 401}})
    return replace(stats(tmp, run), needles=("note: ", "trainer_state.json: 2 integers past 64 bits ignored"))


@case("trainer_state.json: a 5,000-digit grad norm, losses 1e999 and NaN (ignored, noted)")
def _(run, tmp):
    log_numbers(run, {1: {"grad_norm": "1" * 5_000}, 2: {"loss": "1e999"}, 3: {"loss": "NaN"}})
    return Case(("--heal", run, "--recipe", tmp / "healed.yaml"), 0, ("note: ", "5,000 digits"),
                {"TAILOR_TUI_CACHE": str(tmp / "cache")})


def _name_ds_config(run: Path, config: Path) -> None:
    """checkpoint-6's model_states name `config` as the DeepSpeed config file (as DeepSpeed before
    0.16 recorded a config passed as a file), rewritten by the torch-free writer."""
    from tailor_tui.formats.ptwrite import Rewritable, write

    for rank in (0, 1):
        path = run / "checkpoint-6" / MODEL_STATES.format(step=6, rank=rank)
        states = Rewritable(path)
        states.obj["ds_config"] = str(config)
        tmp = path.with_suffix(".new")
        write(states.obj, states.fills, tmp)
        tmp.replace(path)


for _form in ("fifo", "dev-zero", "2 MiB", "nested 100,000 deep"):
    @case(f"ds_config.json: {_form}")
    def _(run, tmp, form=_form):
        config = tmp / "ds_config.json"
        if form == "2 MiB":
            huge(config, 2 * MiB)
        elif form.startswith("nested"):
            deep_json(config)
        else:
            special(form, config)
        _name_ds_config(run, config)
        return Case(("--apply", recipe(tmp, run), "--world-size", "1", "--dry-run"), 4, ("ds_config.json",))


# --- rank files: the zip archive, its data.pkl ----------------------------------------------

for _form in ("fifo", "dev-zero"):
    @case(f"optim_states: {_form}")
    def _(run, tmp, form=_form):
        special(form, run / "checkpoint-4" / OPTIM.format(step=4, rank=1))
        return dry_run(tmp, run, 4, "optim_states.pt")

    @case(f"model_states rank 1: {_form}")
    def _(run, tmp, form=_form):
        special(form, run / "checkpoint-4" / MODEL_STATES.format(step=4, rank=1))
        return dry_run(tmp, run, 4, "model_states.pt")


@case("zip: end record cut off")
def _(run, tmp):
    path = run / "checkpoint-4" / OPTIM.format(step=4, rank=1)
    os.truncate(path, path.stat().st_size - 10)
    return dry_run(tmp, run, 4, "optim_states.pt")


def end_record(entries: int, directory: int, offset: int) -> bytes:
    return struct.pack("<IHHHHIIH", 0x06054B50, 0, 0, min(entries, 0xFFFF), min(entries, 0xFFFF),
                       directory, offset, 0)


@case("zip: a 1 GiB central directory claimed")
def _(run, tmp):
    path = huge(run / "checkpoint-4" / OPTIM.format(step=4, rank=1), 1 << 30)
    with open(path, "r+b") as f:
        f.write(b"PK\x03\x04")
        f.seek((1 << 30) - 22)
        f.write(end_record(1, (1 << 30) - 22, 0))
    return dry_run(tmp, run, 4, "optim_states.pt")


@case("zip: 1,000,000 records listed")
def _(run, tmp):
    count, entry = 1_000_000, struct.pack("<IHHHHHHIIIHHHHHII", 0x02014B50, 20, 20, 0, 0, 0, 0, 0, 0, 0, 1, 0,
                                          0, 0, 0, 0, 0) + b"x"
    path = run / "checkpoint-4" / OPTIM.format(step=4, rank=1)
    with open(path, "wb") as f:
        f.write(b"PK\x03\x04" + bytes(26) + entry * count + end_record(count, len(entry) * count, 30))
    return dry_run(tmp, run, 4, "optim_states.pt")


@case("zip: a zip64 end record claiming 2**40 records")
def _(run, tmp):
    path = run / "checkpoint-4" / OPTIM.format(step=4, rank=1)
    data = bytearray(path.read_bytes())  # torch writes zip64 end records whatever the size
    struct.pack_into("<QQ", data, data.rfind(b"PK\x06\x06") + 24, 1 << 40, 1 << 40)
    path.write_bytes(data)
    return dry_run(tmp, run, 4, "optim_states.pt", "1,099,511,627,776 records")


def with_pickle(path: Path, data: bytes) -> None:
    """`path` (a zip-format torch file) with its data.pkl replaced by `data`."""
    import zipfile

    new = path.with_suffix(".new")
    with zipfile.ZipFile(path) as z, zipfile.ZipFile(new, "w", zipfile.ZIP_STORED) as out:
        for info in z.infolist():
            out.writestr(info, data if info.filename.endswith("/data.pkl") else z.read(info))
    new.replace(path)


def size_bomb(copies: int = 2000, width: int = 100_000) -> bytes:
    """torch.Size built `copies` times on one memoized tuple of `width` ints (1.5 GB unpickled)."""
    return b"".join([b"\x80\x02ctorch\nSize\nq\x00(", b"K\x00" * width, b"tq\x01](", b"h\x00h\x01\x85R" * copies,
                     b"e."])


def rebuild_bomb(records: int = 2_000_000) -> bytes:
    """`records` tensors rebuilt from one memoized argument tuple: 10 MB of pickle, 600 MiB built."""
    pid = b"(X\x07\x00\x00\x00storagectorch\nFloatStorage\nX\x01\x00\x00\x000X\x03\x00\x00\x00cpuK\x04tQ"
    return b"".join([b"\x80\x02ctorch._utils\n_rebuild_tensor_v2\nq\x00(", pid, b"K\x00)\x29\x89tq\x01](",
                     b"h\x00h\x01R" * records, b"e."])


def shared_tuples(levels: int = 100) -> bytes:
    """A tuple of two references to a tuple of two references to … (`levels` deep): a few hundred
    bytes that unfold to 2**levels objects (hashing or printing it never ends)."""
    out = [b"\x80\x02K\x01K\x01\x86r\x00\x00\x00\x00"]
    for i in range(1, levels):
        out.append(b"j" + (i - 1).to_bytes(4, "little") + b"j" + (i - 1).to_bytes(4, "little") + b"\x86r"
                   + i.to_bytes(4, "little"))
    return b"".join(out)


def hash_bomb() -> bytes:
    """A dict whose one key is `shared_tuples`: building it hashes 2**100 tuples."""
    return shared_tuples() + b"}j" + (99).to_bytes(4, "little") + b"Ns."


def repr_bomb() -> bytes:
    """A storage whose persistent id names `shared_tuples` as its kind: one error message that
    printed it would never end."""
    return (shared_tuples() + b"(j" + (99).to_bytes(4, "little")
            + b"ctorch\nFloatStorage\nX\x01\x00\x00\x000X\x03\x00\x00\x00cpuK\x04tQ.")


def cycle() -> bytes:
    """A list that holds itself, as the state dict's value."""
    return b"\x80\x02}q\x00X\x01\x00\x00\x00a]q\x01h\x01as."


for _name, _bomb, _why in (("2,000 Sizes of one 100,000-element tuple", size_bomb, ()),
                           ("2,000,000 tensors of one memoized tuple", rebuild_bomb, ()),
                           ("a dict keyed by 2**100 shared tuples", hash_bomb, ()),
                           ("a storage id of 2**100 shared tuples", repr_bomb, ()),
                           ("a list that holds itself", cycle, ())):
    @case(f"data.pkl: {_name}")
    def _(run, tmp, bomb=_bomb, why=_why):
        with_pickle(run / "checkpoint-4" / MODEL_STATES.format(step=4, rank=0), bomb())
        return dry_run(tmp, run, 4, "model_states.pt", *why)


# --- weight files: safetensors headers, a .bin ----------------------------------------------

def safetensors(path: Path, header: bytes, data: int = 4) -> None:
    path.unlink()
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(header)) + header + bytes(data))


def tensor(name: str = "t", shape: str = "[1]", end: int = 4) -> str:
    return f'"{name}":{{"dtype":"F32","shape":{shape},"data_offsets":[0,{end}]}}'


for _form in ("fifo", "dev-zero"):
    @case(f"model.safetensors: {_form}")
    def _(run, tmp, form=_form):
        special(form, run / "checkpoint-4" / "model.safetensors")
        return dry_run(tmp, run, 4, "model.safetensors", "not a regular file")


@case("safetensors: a header of 2**60 bytes claimed")
def _(run, tmp):
    path = run / "checkpoint-4" / "model.safetensors"
    with open(path, "r+b") as f:
        f.write(struct.pack("<Q", 1 << 60))
    return dry_run(tmp, run, 4, "model.safetensors")


@case("safetensors: 20 MB of header for one tensor")
def _(run, tmp):
    pad = ",".join(["0"] * 10_000_000)
    safetensors(run / "checkpoint-4" / "model.safetensors", f'{{{tensor()},"pad":[{pad}]}}'.encode())
    return dry_run(tmp, run, 4, "model.safetensors", "for 1 tensor(s)")


@case("safetensors: 30 MB of header, 2M decoy tensor names")
def _(run, tmp):
    decoys = ",".join(['"data_offsets"'] * 2_000_000)  # each a tensor's allowance, none a tensor
    safetensors(run / "checkpoint-4" / "model.safetensors", f'{{{tensor()},"pad":[{decoys}]}}'.encode())
    return dry_run(tmp, run, 4, "model.safetensors")


@case("safetensors: 4 MB of header, 4,000 tensors of 300 empty lists each")
def _(run, tmp):
    empties = ",".join(["[]"] * 300)  # within 1 KiB a tensor: 1.2M lists, ~90 MB once parsed
    entries = ",".join(f'"t{i}":{{"dtype":"F32","shape":[0],"data_offsets":[0,0],"x":[{empties}]}}'
                       for i in range(4_000))
    safetensors(run / "checkpoint-4" / "model.safetensors", f"{{{entries}}}".encode())
    return dry_run(tmp, run, 4, "model.safetensors")


@case("safetensors: a tensor of 2**62 elements in its 64 bytes")
def _(run, tmp):
    path = run / "checkpoint-4" / "model.safetensors"
    data = path.read_bytes()
    (length,) = struct.unpack("<Q", data[:8])
    header = json.loads(data[8: 8 + length])
    header["model.layers.1.input_layernorm.weight"]["shape"] = [1 << 62]
    safetensors(path, json.dumps(header, separators=(",", ":")).encode(), 0)
    with open(path, "ab") as f:
        f.write(data[8 + length:])
    return dry_run(tmp, run, 4, "model.safetensors", "input_layernorm", "do not fit")


for _form in ("fifo", "dev-zero"):
    @case(f"pytorch_model.bin: {_form}")
    def _(run, tmp, form=_form):
        special(form, run / "checkpoint-6" / "pytorch_model.bin")
        return dry_run(tmp, run, 4, "pytorch_model.bin", "not a regular file")


@case("pytorch_model.bin: a dict keyed by 2**100 shared tuples")
def _(run, tmp):
    for step in (4, 6):  # the base's and the source's: the base's is read
        path = run / f"checkpoint-{step}" / "pytorch_model.bin"
        path.write_bytes((run / "checkpoint-6" / "scheduler.pt").read_bytes())
        with_pickle(path, hash_bomb())
    return dry_run(tmp, run, 4, "pytorch_model.bin", "MiB of objects")


# --- the base's other files, an output's provenance record, the statistics cache ------------

@case("scheduler.pt: fifo")
def _(run, tmp):
    fifo(run / "checkpoint-6" / "scheduler.pt")
    return dry_run(tmp, run, 4, "scheduler.pt", "not a regular file")


@case("scheduler.pt: 256 MiB deflated to 1 MiB")
def _(run, tmp):
    import zipfile

    path = run / "checkpoint-6" / "scheduler.pt"
    path.unlink()
    with zipfile.ZipFile(path, "w", zipfile.ZIP_DEFLATED, compresslevel=1) as z, \
            z.open("archive/data.pkl", "w", force_zip64=True) as f:
        block = bytes(16 * MiB)
        for _ in range(16):
            f.write(block)
    return Case(("--apply", recipe(tmp, run)), 4, ("scheduler.pt", "zip bomb"))


def provenance(tmp: Path, run: Path, make) -> Case:
    out = tmp / "composed"
    out.mkdir()
    make(out / "tailor_provenance.json")
    return Case(("--apply", recipe(tmp, run), "--force"), 6, ("tailor_provenance.json", "unreadable"))


for _form in ("fifo", "dev-zero"):
    @case(f"provenance: {_form}")
    def _(run, tmp, form=_form):
        return provenance(tmp, run, lambda p: special(form, p))


@case("provenance: 65 MiB")
def _(run, tmp):
    return provenance(tmp, run, lambda p: huge(p, 65 * MiB))


@case("provenance: nested 100,000 deep")
def _(run, tmp):
    return provenance(tmp, run, deep_json)


# --- --force replaces only what tailor-tui can prove it wrote; no output inside a checkpoint --

def forced(tmp: Path, run: Path, change, *needles: str) -> Case:
    """An earlier output (a real composition) changed by `change(output)`; `--apply --force`
    must refuse to replace it, exit 6, naming what `needles` say."""
    path, out = composed(tmp, run)
    change(out)
    return Case(("--apply", path, "--force"), 6, ("--force replaces only", *needles))


def record(out: Path, edit) -> None:
    """The output's provenance record, as `edit(record)` leaves it."""
    path = out / "tailor_provenance.json"
    data = json.loads(path.read_text())
    edit(data)
    path.write_text(json.dumps(data))


@case("--force: an older tailor-tui's output (no file list) that training resumed into")
def _(run, tmp):
    def change(out):
        record(out, lambda r: r.pop("files"))
        subprocess.run(["cp", "-a", str(run / "checkpoint-6"), str(out / "checkpoint-8")], check=True)
    return forced(tmp, run, change, "without the list of files", "checkpoint-8")


FORCED = {  # name -> (change to a listed output, what the one line names)
    "a file it did not write": (lambda out: (out / "notes.txt").write_text("mine"), ("also holds notes.txt",)),
    "a folder it did not write": (lambda out: (out / "mine").mkdir(), ("also holds mine/",)),
    "a FIFO": (lambda out: os.mkfifo(out / "pipe"), ("pipe (a FIFO)",)),
    "a symbolic link to a folder": (lambda out: (out / "elsewhere").symlink_to(out.parent),
                                    ("elsewhere (a symbolic link)",)),
    "a listed file now a symbolic link": (lambda out: (out / "latest").unlink() or (out / "latest").symlink_to(
        out / "global_step6" / "zero_pp_rank_0_mp_rank_00_model_states.pt"), ("latest (now a symbolic link)",)),
    "a listed file now a folder": (lambda out: (out / "latest").unlink() or (out / "latest").mkdir(),
                                   ("latest (now a folder)",)),
    "a listed file gone": (lambda out: (out / "scheduler.pt").unlink(), ("scheduler.pt is gone",)),
    "a record listing ../x": (lambda out: record(out, lambda r: r["files"].update({"../x": [1, 1]})),
                              ("'../x'", "not a file inside the output")),
    "a record listing an absolute path": (lambda out: record(out, lambda r: r["files"].update({"/etc/x": [1, 1]})),
                                          ("'/etc/x'", "not a file inside the output")),
    "a record whose file list is not a table": (lambda out: record(out, lambda r: r.update(files=[])),
                                                ("not a table of file names",)),
    "a record that is not JSON": (lambda out: (out / "tailor_provenance.json").write_bytes(b"\xff{not json"),
                                  ("tailor_provenance.json", "unreadable")),
    "a record that is a symbolic link": (lambda out: os.replace(out / "tailor_provenance.json", out.parent / "r")
                                         or (out / "tailor_provenance.json").symlink_to(out.parent / "r"),
                                         ("tailor_provenance.json", "unreadable")),
}
for _name, (_change, _needles) in FORCED.items():
    @case(f"--force: {_name}")
    def _(run, tmp, change=_change, needles=_needles):
        return forced(tmp, run, change, *needles)


for _output, _force in (("checkpoint-2/fixed", ""), ("checkpoint-2/global_step2/fixed", ""),
                        ("checkpoint-2", "--force")):
    @case(f"an output at {_output} (a training checkpoint, no source)")
    def _(run, tmp, output=_output, force=_force):
        path = tmp / "inside.yaml"
        path.write_text(f"version: 1\nbase: {run / 'checkpoint-6'}\noutput: {run / output}\n"
                        f"layers:\n  layers.1: {run / 'checkpoint-4'}\n")
        what = "is training checkpoint" if output == "checkpoint-2" else "would nest inside training checkpoint"
        return Case(("--apply", path, *([force] if force else [])), 6, (what, "checkpoint-2"))


@case("statistics cache: every entry hostile (skipped)")
def _(run, tmp):
    env = {"TAILOR_TUI_CACHE": str(tmp / "cache")}
    subprocess.run([tailor_path(), "--stats", str(run), "--json"], env={**os.environ, **env}, check=True,
                   capture_output=True, stdin=subprocess.DEVNULL)
    entries = sorted((tmp / "cache").rglob("*.json"))
    forms = (fifo, dev_zero, lambda p: huge(p, 65 * MiB), deep_json)
    for i, path in enumerate(entries):
        forms[i % len(forms)](path)
    return Case(("--stats", run, "--json"), 0, env=env)


def composed(tmp: Path, run: Path) -> tuple[Path, Path]:
    """(recipe, output) of a real composition, for --verify."""
    path = recipe(tmp, run)
    subprocess.run([tailor_path(), "--apply", str(path)], check=True, capture_output=True, stdin=subprocess.DEVNULL)
    return path, tmp / "composed"


for _form in ("fifo", "dev-zero"):
    @case(f"--verify, the output's optim_states: {_form}")
    def _(run, tmp, form=_form):
        path, out = composed(tmp, run)
        special(form, out / OPTIM.format(step=6, rank=1))
        return Case(("--verify", path), 4, ("optim_states.pt", "not a regular file"))

    @case(f"--verify, the output's provenance: {_form}")
    def _(run, tmp, form=_form):
        path, out = composed(tmp, run)
        special(form, out / "tailor_provenance.json")
        return Case(("--verify", path), 7, ("verification failed",))


@case("--heal, the newest rng_state_0.pth: fifo (skipped, warned)")
def _(run, tmp):
    fifo(run / "checkpoint-6" / "rng_state_0.pth")
    return Case(("--heal", run, "--recipe", tmp / "healed.yaml"), 0, ("warning: skipped", "rng_state_0.pth"),
                env={"TAILOR_TUI_CACHE": str(tmp / "cache")})


@case("--stats, a manifest: fifo (the checkpoint skipped)")
def _(run, tmp):
    fifo(run / "checkpoint-4" / "tailor_partial.json")
    return stats(tmp, run)


def tailor_path() -> str:
    return str(Path(sys.executable).with_name("tailor-tui"))


def snapshot(folder: Path, skip: str = "cache") -> dict[str, tuple]:
    """Every path under `folder` but those under `skip` (the statistics cache), links not
    followed: its type, and a file's size and mtime."""
    found = {}
    for dirpath, dirnames, filenames in os.walk(folder):
        dirnames[:] = [d for d in dirnames if os.path.join(dirpath, d) != os.path.join(folder, skip)]
        for name in dirnames + filenames:
            st = os.lstat(os.path.join(dirpath, name))
            found[os.path.relpath(os.path.join(dirpath, name), folder)] = \
                (st.st_mode,) if name in dirnames else (st.st_mode, st.st_size, st.st_mtime_ns)
    return found
