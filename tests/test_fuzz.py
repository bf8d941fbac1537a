"""Fuzzed, not only spot-checked (issue 43): every bit of the zip metadata of each torch file kind a
run holds — the central directory, the end records, each local header and data descriptor — is
flipped in turn (a seeded sample where a file has more than MAX_BITS such bits), and the file is
read the way every path of tailor-tui reads one before trusting or copying it (`check_crcs`, read
whole and streamed, and `read_structure`). Each mutation must end either in a one-line
CheckpointError, or, where tailor-tui accepts the file, in a file torch's own reader loads to the
same values as the original (the flipped bit is one nobody reads: a time stamp, alignment padding).
Never another exception, never an accepted file torch cannot load or reads otherwise. The
safetensors kinds likewise: every bit of a model.safetensors' and a PEFT adapter's 8-byte length
and JSON header, and of a shard index, read as every path reads them; accepted, the safetensors
library loads what tailor-tui's reader says the file holds. And every integer of transformers' own
configs of a dozen models, set to a million in turn, as a checkpoint's config.json: reading its
weight files' names (which makes a model of it, within bounds) takes seconds and never raises.

The composition in full (the real command line) meets the same mutations in tests/test_zip_records.py;
here the readers run in-process so that thousands of mutations take seconds. The counts and the
time are printed (`pytest -s`); TAILOR_FUZZ_BITS raises the sample (a nightly variant).
"""

from __future__ import annotations

import json
import os
import random
import re
import shutil
import struct
import time
import zipfile
from pathlib import Path

import numpy as np
import pytest
import torch

from tailor_tui.errors import CheckpointError
from tailor_tui.formats.ptfile import check_crcs, read_structure
from tailor_tui.kinds.folders import HF

MAX_BITS = int(os.environ.get("TAILOR_FUZZ_BITS", 1500))  # per file kind
KINDS = {
    "model_states": "checkpoint-6/global_step6/zero_pp_rank_1_mp_rank_00_model_states.pt",
    "optim_states": "checkpoint-6/global_step6/bf16_zero_pp_rank_1_mp_rank_00_optim_states.pt",
    "rng_state": "checkpoint-6/rng_state_1.pth",
    "scheduler.pt": "checkpoint-6/scheduler.pt",
}


def metadata_bytes(data: bytes) -> list[int]:
    """Offsets of every byte of the archive's zip metadata: local headers (with their extra fields)
    and data descriptors, central directory entries, end records."""
    spots: list[int] = []
    with zipfile.ZipFile(__import__("io").BytesIO(data)) as z:
        start = z.start_dir
        for info in z.infolist():
            at = info.header_offset
            name_len, extra_len = struct.unpack_from("<HH", data, at + 26)
            data_end = at + 30 + name_len + extra_len + info.compress_size
            spots += range(at, at + 30 + name_len + extra_len)
            if info.flag_bits & 0x08:
                spots += range(data_end, data_end + 16)
    spots += range(start, len(data))  # the central directory and the end records
    return sorted(set(spots))


def same(a, b) -> bool:
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and a.shape == b.shape and bool(torch.equal(a, b))
    if isinstance(a, np.ndarray):
        return isinstance(b, np.ndarray) and np.array_equal(a, b)
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(same(x, y) for x, y in zip(a, b))
    if hasattr(a, "__dict__") and not isinstance(a, type):
        return type(a) is type(b) and same(vars(a), vars(b))
    return a == b


def read_as_tailor(path: Path, rank_file: bool) -> None:
    """What every path does with a torch file before trusting or copying it (CheckpointError if it
    refuses): a side file is checked and copied, a rank file's structure read too."""
    check_crcs(path)
    check_crcs(path, small=0)
    if rank_file:
        read_structure(path)


def attempt(read, where: str, named: str):
    """(the one line `read()` is refused with, None) or (None, what it returned): a refusal is a
    CheckpointError of one line naming `named`; any other exception fails the test (`where`: the
    mutation, for its message)."""
    try:
        return None, read()
    except CheckpointError as exc:
        line = str(exc)
        assert "\n" not in line and named in line, (where, line)
        return line, None
    except Exception as exc:  # noqa: BLE001 (any other exception is the failure looked for)
        pytest.fail(f"{where}: {type(exc).__name__}: {exc}")


@pytest.mark.parametrize("kind", list(KINDS))
def test_every_flipped_bit_of_zip_metadata_is_refused_in_one_line_or_harmless(real_run, tmp_path, kind):
    run, _spec = real_run("hf_bf16_2")
    original = (run / KINDS[kind]).read_bytes()
    target = tmp_path / Path(KINDS[kind]).name  # its name: torch finds the records under it
    shutil.copy(run / KINDS[kind], target)
    read_as_tailor(target, kind.endswith("_states"))
    expected = torch.load(target, weights_only=False)
    bits = [(at, bit) for at in metadata_bytes(original) for bit in range(8)]
    if len(bits) > MAX_BITS:
        bits = random.Random(43).sample(bits, MAX_BITS)
    began, refused, accepted, messages = time.monotonic(), 0, 0, set()
    for at, bit in bits:
        mutated = bytearray(original)
        mutated[at] ^= 1 << bit
        target.write_bytes(mutated)
        line, _ = attempt(lambda: read_as_tailor(target, kind.endswith("_states")), f"byte {at} bit {bit}",
                          str(target))
        if line is not None:
            refused += 1
            messages.add(line.split(": ", 2)[-1][:40])
            continue
        accepted += 1
        try:
            loaded = torch.load(target, weights_only=False)
        except Exception as exc:  # noqa: BLE001
            pytest.fail(f"byte {at} bit {bit}: accepted, but torch cannot load it: {exc}")
        assert same(loaded, expected), f"byte {at} bit {bit}: accepted, but torch reads other values"
    took = time.monotonic() - began
    print(f"\n{kind}: {len(bits)} mutations of {len(original):,} bytes in {took:.1f}s: "
          f"{refused} refused in one line, {accepted} harmless (loaded by torch, same values)")
    assert refused and accepted  # both outcomes happen: the test can fail either way


# safetensors files: every bit of the 8-byte length and of the JSON header (a seeded sample of
# MAX_BITS), read as every path reads one (`safetensors_in.safetensors_tensors`)
SAFETENSORS_KINDS = {
    "model.safetensors": ("hf_bf16_2", "checkpoint-6/model.safetensors"),
    "adapter_model.safetensors": ("hf_peft_lora", "checkpoint-4/adapter_model.safetensors"),
}


def _tensors(path: Path) -> dict:
    """Every tensor of a safetensors file as the safetensors library loads it (raises what it raises)."""
    from safetensors import safe_open

    with safe_open(str(path), "pt") as f:
        return {name: f.get_tensor(name) for name in f.keys()}


def _raw(tensor) -> bytes:
    return tensor.reshape(-1).view(torch.uint8).numpy().tobytes()


def _sample(spots: range | list[int], bits: int = 8) -> list[tuple[int, int]]:
    every = [(at, bit) for at in spots for bit in range(bits)]
    return random.Random(43).sample(every, MAX_BITS) if len(every) > MAX_BITS else every


def _flips(path: Path, original: bytes, bits: list[tuple[int, int]]):
    """(byte, bit, the file's bytes) for each bit of `bits` flipped in turn in the file at `path`
    (holding `original`), in place: a rewrite of the whole file would cost more than the reading
    tested. The file is the original again at the end."""
    fd = os.open(path, os.O_RDWR)
    try:
        for at, bit in bits:
            os.pwrite(fd, bytes([original[at] ^ (1 << bit)]), at)
            mutated = bytearray(original)
            mutated[at] ^= 1 << bit
            yield at, bit, bytes(mutated)
            os.pwrite(fd, original[at: at + 1], at)
    finally:
        os.close(fd)


@pytest.mark.parametrize("kind", list(SAFETENSORS_KINDS))
def test_every_flipped_bit_of_a_safetensors_header_is_refused_in_one_line_or_harmless(real_run, tmp_path, kind):
    """Accepted, a file loads with the safetensors library to the tensors tailor-tui's reader
    says it holds — the same names, dtypes, shapes and bytes where it says they lie — and each
    tensor of a name the original has, with the original's dtype and shape, equals it."""
    from tailor_tui.formats.dtypes import SAFETENSORS_NAME
    from tailor_tui.formats.safetensors_in import safetensors_tensors

    name, rel = SAFETENSORS_KINDS[kind]
    run, _spec = real_run(name)
    original = (run / rel).read_bytes()
    target = tmp_path / Path(rel).name
    target.write_bytes(original)
    expected = _tensors(target)
    assert safetensors_tensors(target).keys() == expected.keys()
    (length,) = struct.unpack("<Q", original[:8])
    bits = _sample(range(8 + length))
    began, refused, accepted, renamed = time.monotonic(), 0, 0, 0
    for at, bit, mutated in _flips(target, original, bits):
        line, places = attempt(lambda: safetensors_tensors(target), f"byte {at} bit {bit}", f"{target}: ")
        if line is not None:
            refused += 1
            continue
        accepted += 1
        try:
            loaded = _tensors(target)
        except Exception as exc:  # noqa: BLE001
            pytest.fail(f"byte {at} bit {bit}: accepted, but the safetensors library refuses it: {exc}")
        assert loaded.keys() == places.keys(), (at, bit)
        for tensor_name, (dtype, shape, begin, end) in places.items():
            got = loaded[tensor_name]
            assert SAFETENSORS_NAME[str(got.dtype).removeprefix("torch.")] == dtype, (at, bit, tensor_name)
            assert tuple(got.shape) == shape and _raw(got) == mutated[begin:end], (at, bit, tensor_name)
            was = expected.get(tensor_name)
            if was is not None and was.dtype == got.dtype and was.shape == got.shape:
                assert torch.equal(was, got), (at, bit, tensor_name)
            else:
                renamed += 1
    took = time.monotonic() - began
    print(f"\n{kind}: {len(bits)} mutations of its {8 + length:,}-byte header in {took:.1f}s: {refused} refused "
          f"in one line, {accepted} accepted (loaded by the safetensors library as read; {renamed} tensor(s) "
          "under another name, dtype or shape)")
    assert refused and accepted


def test_every_flipped_bit_of_a_shard_index_is_refused_in_one_line_or_harmless(real_run, tmp_path):
    """`model.safetensors.index.json` of a sharded model, read as a checkpoint's model files and
    the base's layout are (`hf_model_files`, `ModelFileLayout.of_files`). Accepted, it maps each
    tensor to the shard that holds it: each loads from there equal to the original."""
    from tailor_tui.checkpoints.checkpoint import MODEL_FILE_INDEX, hf_model_files
    from tailor_tui.checkpoints.model_layout import ModelFileLayout

    run, _spec = real_run("hf_sharded_safetensors")
    folder = tmp_path / "run" / "checkpoint-4"
    shutil.copytree(run / "checkpoint-4", folder, symlinks=True)
    index = folder / MODEL_FILE_INDEX
    original = index.read_bytes()
    expected = {}
    for shard in hf_model_files(folder):
        expected |= _tensors(shard)
    bits = _sample(range(len(original)))
    by_shard = {shard.name: set(_tensors(shard)) for shard in hf_model_files(folder)}
    began, refused, accepted = time.monotonic(), 0, 0
    for at, bit, _mutated in _flips(index, original, bits):
        line, layout = attempt(lambda: ModelFileLayout.of_files(hf_model_files(folder)), f"byte {at} bit {bit}",
                               str(folder))
        if line is not None:
            refused += 1
            continue
        accepted += 1
        weight_map = __import__("json").loads(layout.index)["weight_map"]
        assert weight_map.keys() == expected.keys(), (at, bit)
        for tensor_name, shard in weight_map.items():  # the shards are the original's: each tensor where it was
            assert tensor_name in by_shard[shard], (at, bit, tensor_name)
        for shard in {folder / shard for shard in weight_map.values()}:
            assert all(torch.equal(t, expected[n]) for n, t in _tensors(shard).items()), (at, bit, shard)
    took = time.monotonic() - began
    print(f"\n{MODEL_FILE_INDEX}: {len(bits)} mutations of {len(original):,} bytes in {took:.1f}s: {refused} "
          f"refused in one line, {accepted} accepted (each tensor where the index says, equal)")
    assert refused and accepted


PICKLED = {"rng_state": KINDS["rng_state"], "scheduler.pt": KINDS["scheduler.pt"]}


def pickle_record(data: bytes) -> tuple[int, int, int, int]:
    """(first byte, size, local header's CRC-32 offset, central entry's) of the data.pkl record of a
    zip archive Python's zipfile wrote (stored, no data descriptor)."""
    with zipfile.ZipFile(__import__("io").BytesIO(data)) as z:
        info = next(i for i in z.infolist() if i.filename.endswith("/data.pkl"))
        at = info.header_offset
        name_len, extra_len = struct.unpack_from("<HH", data, at + 26)
        central = z.start_dir
        while not data[central + 46: central + 46 + len(info.orig_filename)] == info.orig_filename.encode():
            n, e, c = struct.unpack_from("<HHH", data, central + 28)
            central += 46 + n + e + c
    return at + 30 + name_len + extra_len, info.file_size, at + 14, central + 16


@pytest.mark.parametrize("kind", list(PICKLED))
def test_every_flipped_bit_or_byte_of_a_side_files_pickle_is_refused_in_one_line_or_loads(real_run, tmp_path, kind):
    """Bits and bytes of the pickle record (data.pkl) of rng_state and scheduler.pt flipped, the CRC-32s
    made right again (so no CRC check hides them), a seeded sample of MAX_BITS / 2 each (bits and bytes): `check_side_file`
    (what --apply and --heal run on a file copied whole) either refuses it in one line naming the file, or
    torch.load(weights_only=False) loads it (the values may differ: a flip inside a pickled value)."""
    from side_pickles_helpers import rezipped

    from tailor_tui.checked import crc
    from tailor_tui.formats.side_pickles import check_side_file

    run, _spec = real_run("hf_bf16_2")
    target = tmp_path / Path(PICKLED[kind]).name  # its name: torch finds the records under it
    original = rezipped(run / PICKLED[kind])
    start, size, local_crc, central_crc = pickle_record(original)
    target.write_bytes(original)
    check_side_file(target)
    rng = random.Random(43)
    bits = [(at, 1 << bit) for at in range(start, start + size) for bit in range(8)]
    mutations = rng.sample(bits, min(len(bits), MAX_BITS // 4))  # half of MAX_BITS: each accepted one is loaded
    mutations += [(at, rng.randrange(1, 256)) for at in rng.choices(range(start, start + size), k=MAX_BITS // 4)]
    began, refused, accepted, messages = time.monotonic(), 0, 0, set()
    for at, xor in mutations:
        mutated = bytearray(original)
        mutated[at] ^= xor
        value = crc.crc32(mutated[start: start + size])
        struct.pack_into("<I", mutated, local_crc, value)
        struct.pack_into("<I", mutated, central_crc, value)
        target.write_bytes(mutated)
        line, _ = attempt(lambda: check_side_file(target), f"byte {at} ^ {xor:#04x}", str(target))
        if line is not None:
            refused += 1
            messages.add(line.split(": ", 3)[-1][:30])
            continue
        accepted += 1
        try:
            torch.load(target, weights_only=False)
        except Exception as exc:  # noqa: BLE001
            pytest.fail(f"byte {at} ^ {xor:#04x}: accepted, but torch cannot load it: {type(exc).__name__}: {exc}")
    took = time.monotonic() - began
    print(f"\n{kind} pickle: {len(mutations)} mutations of {size:,} bytes in {took:.1f}s: {refused} refused in "
          f"one line ({len(messages)} kinds of line), {accepted} loaded by torch")
    assert refused and accepted  # both outcomes happen: the test can fail either way


# --- a recipe's whole numbers (issue 58) -----------------------------------------------------------

# What a number in a recipe may be spelt with: ASCII digits, other scripts' digits (which int() reads),
# digits int() refuses (superscripts, circled), fullwidth digits, YAML 1.1's signs, `_`, bases and `:`
NUMBER_CHARS = "0123456789" * 4 + "٣۷৪६๓０９²³¹①⁰_+-xobXB:.e " + "abcdef"


def _spelling(rng: random.Random) -> str:
    length = rng.choice([1, 2, 3, 5, 19, 20, 40, rng.randint(1, 5000)])
    return "".join(rng.choice(NUMBER_CHARS) for _ in range(length))


def test_every_spelling_of_a_recipes_whole_number_is_read_plainly_or_refused_in_one_line():
    """Seeded spellings as `world_size` and as an LLMTailor `layer_range` end, plain and as `!!int "…"`:
    each is read as the plain ASCII decimal number it is (no leading zero, below 2**63), or refused in a
    one-line RecipeError of bounded length; never another exception (int()'s ValueError, an internal error)."""
    from tailor_tui.errors import RecipeError
    from tailor_tui.planning.mergekit import looks_like
    from tailor_tui.planning.mergekit import parse as parse_llmtailor
    from tailor_tui.planning.recipe import parse_recipe

    rng, read, refused = random.Random(58), 0, 0
    started = time.perf_counter()
    for _ in range(MAX_BITS // 3):  # 500 spellings, four ways each: 2,000 recipes
        text = _spelling(rng)
        for written, spelt in ((text, text.strip(" ")), ('!!int "' + text + '"', text)):  # YAML strips a plain one
            plain = spelt.isascii() and spelt.isdigit() and (spelt == "0" or spelt[0] != "0") and int(spelt) < 1 << 63
            for kind in ("world_size", "layer_range"):
                yaml_text = (f"version: 1\nbase: b\nworld_size: {written}\n" if kind == "world_size" else
                             f"slices:\n  - sources: [{{model: m, layer_range: [0, {written}]}}]\n"
                             "merge_method: passthrough\n")
                try:
                    if kind == "world_size":
                        value = parse_recipe(yaml_text, source="r.yaml").world_size
                    elif not looks_like(yaml_text):  # malformed YAML: read as tailor-tui's, which says so
                        value = parse_recipe(yaml_text, source="r.yaml").world_size
                    else:
                        value = parse_llmtailor(yaml_text, "r.yaml").slices[0].end
                except RecipeError as exc:
                    message = str(exc)
                    assert message.startswith("r.yaml") and "\n" not in message and len(message) < 500, message
                    refused += 1
                    continue
                read += 1
                assert plain and value == int(spelt), (kind, written, value)
    print(f"\n{read} spellings read, {refused} refused in {time.perf_counter() - started:.1f} s")
    assert read and refused


# A model is made of a checkpoint's config.json to read its weight files' names (checkpoints/saved_names):
# every count of transformers' own configs of these models, in turn, asking for a million
CONFIG_MODELS = {"llama": "LlamaForCausalLM", "gpt2": "GPT2LMHeadModel", "gpt_neox": "GPTNeoXForCausalLM",
                 "t5": "T5ForConditionalGeneration", "bart": "BartForConditionalGeneration",
                 "albert": "AlbertForMaskedLM", "swin": "SwinForImageClassification",
                 "beit": "BeitForMaskedImageModeling", "llava": "LlavaForConditionalGeneration",
                 "mllama": "MllamaForConditionalGeneration", "deepseek_v3": "DeepseekV3ForCausalLM",
                 "nemotron_h": "NemotronHForCausalLM"}
MAKE_SECONDS = 15  # the most a config may take here (importing the model's module included)


def _integers(value, path=()):
    """Where `value` (a config as a dict) holds an integer, as paths of keys."""
    if isinstance(value, dict):
        for key, held in value.items():
            yield from _integers(held, (*path, key))
    elif isinstance(value, int) and not isinstance(value, bool):
        yield path


def test_every_count_of_a_config_asking_for_a_million_makes_no_model_past_the_bounds(tmp_path, capsys):
    """Each integer of each config (any key, any depth: layers, experts, heads, widths, token ids),
    set to a million in turn: reading the names takes at most MAKE_SECONDS and never raises (a model
    past the bounds is not made: the table serves)."""
    import signal

    import transformers

    from tailor_tui.checkpoints.saved_names import loading_names

    class TooSlow(BaseException):  # not an Exception: nothing on the way takes it for a failed make
        pass

    def too_slow(*_args):
        raise TooSlow

    previous = signal.signal(signal.SIGALRM, too_slow)
    started, tried = time.monotonic(), 0
    try:
        for model_type, arch in CONFIG_MODELS.items():
            config = transformers.AutoConfig.for_model(model_type).to_dict()
            for path in _integers(config):
                asked = json.loads(json.dumps({**config, "architectures": [arch]}))
                held = asked
                for key in path[:-1]:
                    held = held[key]
                held[path[-1]] = 1_000_000
                (tmp_path / "config.json").write_text(json.dumps(asked))
                signal.alarm(MAKE_SECONDS)
                try:
                    loading_names(tmp_path)
                except TooSlow:
                    pytest.fail(f"{model_type}: {'.'.join(map(str, path))} = 1,000,000 took more than {MAKE_SECONDS} s")
                finally:
                    signal.alarm(0)
                tried += 1
    finally:
        signal.signal(signal.SIGALRM, previous)
    with capsys.disabled():
        print(f"\n{tried} configs of {len(CONFIG_MODELS)} models in {time.monotonic() - started:.0f} s")


# trainer_state.json: its numbers (and its layout), read item by item (`side_files.json_items`) as
# json.loads reads the whole file, and compared (`lineage`) as its entries' repr() were
NUMBERS = ("9" * 401, "-" + "9" * 401, "1" + "0" * 4_400, str(2**64), str(2**64 - 1), str(-2**63), str(-2**63 - 1),
           "1e999", "-1e999", "NaN", "Infinity", "-Infinity", "1.5e-400", "-0", "-0.0", "1E+2", "true", "null",
           '"4"', "[1, [2]]", '{"a": 1}', "1\u0663", "\u0663", "01", "1.", ".5", "+1", "0x1F", "1e", "--1", "1 2")
NUMBER = re.compile(r"-?\d+(?:\.\d+)?(?:[eE][-+]?\d+)?")


def _as_json_loads(raw: bytes):
    """The log history json.loads finds in `raw` (integers past 64 bits as `Unread`, as tailor-tui
    reads them), or None where tailor-tui's rules find none: not JSON, nested past 64 levels, no
    object, no list at `log_history`."""
    from tailor_tui.checkpoints.side_files import Unread

    def integer(digits: str):
        value = int(digits) if len(digits) < 4_300 else None
        return value if value is not None and -2**63 <= value < 2**64 else Unread(digits)

    def deepest(value, above: int = 0) -> int:  # levels of arrays and objects, counted up to 65
        if not isinstance(value, (dict, list)) or above > 64:
            return above
        return max((deepest(v, above + 1) for v in (value.values() if isinstance(value, dict) else value)),
                   default=above + 1)

    try:
        doc = json.loads(raw, parse_int=integer)
    except (ValueError, RecursionError):
        return None
    if deepest(doc) > 64 or not isinstance(doc, dict) or not isinstance(doc.get("log_history"), list):
        return None
    return doc["log_history"]


def _by_repr(entries, step: int) -> tuple:
    """The log history up to `step` as the lineage compared it before issue 58: (step, (key, repr(value)) …)."""
    return tuple((e["step"], tuple(sorted((k, repr(v)) for k, v in e.items()))) for e in entries or ()
                 if isinstance(e, dict) and isinstance(e.get("step"), int) and e["step"] <= step)


def _apart_by_repr(older: tuple, newer: tuple, shared: int) -> str | None:
    start = tuple(entry for entry in newer if entry[0] <= shared)
    if older == start:
        return None
    step = next((x[0] for x, y in zip(older, start) if x != y), None)
    return "their training logs (trainer_state.json) differ" + (f" at step {step}" if step is not None else "")


def _mutations(text: str, rng: random.Random, count: int) -> list[tuple[str, str]]:
    """(what, the mutated text): a number replaced by a hostile one or by another of the file's, a
    character of one changed, the file rewritten in another layout or structure."""
    spots = [m.span() for m in NUMBER.finditer(text)]
    found = []
    for i in range(count):
        start, end = rng.choice(spots)
        if i % 3 == 0:
            new = rng.choice(NUMBERS)
        elif i % 3 == 1:
            new = text.__getitem__(slice(*rng.choice(spots)))
        else:
            at = rng.randrange(start, end)
            new = text[start:at] + rng.choice("0123456789-+.eE\u0663 x,]}") + text[at + 1:end]
        found.append((f"{text[start:end]!r} at {start} -> {new[:20]!r}", text[:start] + new + text[end:]))
    doc = json.loads(text)
    entries = doc["log_history"]
    layouts = {"compact": json.dumps(doc), "indent 1": json.dumps(doc, indent=1), "tabs": json.dumps(doc, indent="\t"),
               "keys reversed": json.dumps({**doc, "log_history": [dict(reversed(e.items())) for e in entries]}),
               "log history twice": text.replace('"log_history": [', '"log_history": [{"step": 1, "loss": 9.0}], '
                                                 '"log_history": [', 1),
               "an empty log history before": '{"log_history": [],' + text.lstrip()[1:],
               "an entry dropped": json.dumps({**doc, "log_history": entries[1:]}),
               "an entry more": json.dumps({**doc, "log_history": [*entries, {**entries[-1], "step": 7}]}, indent=2,
                                           sort_keys=True),
               "the last entry's loss changed": json.dumps({**doc, "log_history": [*entries[:-1], {**entries[-1],
                                                            "loss": 1.0}]}, indent=2, sort_keys=True),
               "two entries swapped": json.dumps({**doc, "log_history": [entries[1], entries[0], *entries[2:]]}),
               "a step true": json.dumps({**doc, "log_history": [{**entries[0], "step": True}, *entries[1:]]}),
               "a step 1.0": json.dumps({**doc, "log_history": [{**entries[0], "step": 1.0}, *entries[1:]]}),
               "an entry nested 70 deep": json.dumps({**doc, "log_history": [*entries, {"step": 1, "x": [[[]]]}]})
               .replace("[[[]]]", "[" * 70 + "]" * 70),
               "UTF-16": text, "a UTF-8 BOM": "\ufeff" + text,
               "the log history an object": text.replace('"log_history": [', '"log_history": {"x": [', 1)}
    return found + list(layouts.items())


def _streamed(path: Path) -> list | None:
    """The items `json_items` gives of the log history in `path` (those after a RESTART), None where it refuses."""
    from tailor_tui.checkpoints.side_files import MAX_RECORD, RESTART, json_items

    items: list = []
    try:
        for item in json_items(path, "log_history", MAX_RECORD):
            if item is RESTART:
                items = []
            else:
                items.append(item)
    except ValueError:
        return None
    return items


def _loss_by_rule(entries, step: int) -> tuple:
    """The loss and grad norm logged at or last before `step`, as read before issue 58."""
    number = lambda v: float(v) if type(v) in (int, float) else None  # noqa: E731 (an `Unread` is no number)
    loss = grad = None
    for e in entries or ():
        if isinstance(e, dict) and isinstance(e.get("step"), int) and e["step"] <= step and number(e.get("loss")) is not None:
            loss, grad = number(e["loss"]), number(e.get("grad_norm"))
    return loss, grad


def test_every_mutated_number_of_a_training_log_is_read_as_json_loads_reads_it(real_run, tmp_path):
    """trainer_state.json of a real run, its numbers replaced by hostile ones (401 and 4,400 digits,
    2⁶⁴, 1e999, NaN, non-ASCII digits …) or by each other, a character of one changed, the file in
    other layouts and structures, as the log of checkpoint 6 then of checkpoint 4: its items, one at
    a time, are json.loads' (`json_items`); the loss and grad norm at the checkpoint's step, and
    whether it is of the other checkpoint's run, are what the rules before issue 58 give on json.loads'
    reading (integers past 64 bits taken for absent: `Unread`); never an exception, nor from the
    composer's curve."""
    from types import SimpleNamespace

    from tailor_tui.checkpoints.lineage import Lineage, logged_at
    from tailor_tui.health.healing import training_curve

    run, _spec = real_run("hf_bf16_2")
    text = (run / "checkpoint-6" / "trainer_state.json").read_text()
    mutations = _mutations(text, random.Random(58), MAX_BITS // 2)
    originals = {s: _as_json_loads((run / f"checkpoint-{s}" / "trainer_state.json").read_bytes()) for s in (4, 6)}
    layout = SimpleNamespace(groups=(), frozen=())
    began, read, ignored, apart = time.monotonic(), 0, 0, 0
    for n, (what, mutated) in enumerate(mutations):
        for step, other in ((6, 4), (4, 6)):
            folder = tmp_path / f"{n}-{step}"
            folder.mkdir()
            raw = mutated.encode("utf-16") if what == "UTF-16" else mutated.encode(errors="surrogatepass")
            (folder / "trainer_state.json").write_bytes(raw)
            expected = _as_json_loads(raw)
            assert repr(_streamed(folder / "trainer_state.json")) == repr(expected), what
            mine = SimpleNamespace(path=folder, step=step, folder=HF, layout=layout)
            theirs = SimpleNamespace(path=run / f"checkpoint-{other}", step=other, folder=HF, layout=layout)
            logged = logged_at(mine)
            assert repr((logged.loss, logged.grad_norm)) == repr(_loss_by_rule(expected, step)), what
            histories = {step: _by_repr(expected, step), other: _by_repr(originals[other], other)}
            want = None if expected is None else _apart_by_repr(histories[4], histories[6], 4)
            assert Lineage().apart(mine, theirs) == want, what
            training_curve([theirs, mine])
            read, ignored, apart = read + (expected is not None), ignored + (expected is None), apart + bool(want)
    took = time.monotonic() - began
    print(f"\ntrainer_state.json: {len(mutations)} mutations, each as the newer and the older log, in {took:.1f}s: "
          f"{read} read, {ignored} ignored (not JSON, no log history), {apart} another run's")
    assert read and ignored and apart


def _nested(rng: random.Random, depth: int, width: int) -> object:
    """A JSON value of arrays and objects nesting exactly `depth` deep, its deepest branch at a random place among
    siblings that nest less (at most two levels: the value stays small) and scalars."""
    if depth == 0:
        return rng.choice([0, "x", None, 1.5, True])
    deep = _nested(rng, depth - 1, width)
    siblings = [_nested(rng, rng.randrange(min(depth, 3)), 1) for _ in range(rng.randrange(width + 1))]
    siblings.insert(rng.randrange(len(siblings) + 1), deep)
    if rng.random() < 0.5:
        return siblings
    return {f"k{i}": v for i, v in enumerate(siblings)}


def _depth(value: object) -> int:
    children = value.values() if isinstance(value, dict) else value if isinstance(value, list) else None
    return 0 if children is None else 1 + max((_depth(v) for v in children), default=0)


def test_json_nesting_is_bounded_at_its_level_whatever_the_shape():
    """A side file's JSON nesting past MAX_DEPTH levels is refused, at MAX_DEPTH read, whatever branch is the
    deepest, wherever it lies among its siblings, arrays and objects mixed (all under the interpreter's recursion
    limit: the bound is parse_json's own walk, not json's RecursionError)."""
    from tailor_tui.checkpoints.side_files import MAX_DEPTH, parse_json

    rng = random.Random(62)
    for n in range(300):
        depth = rng.choice([1, 2, MAX_DEPTH - 1, MAX_DEPTH, MAX_DEPTH + 1, MAX_DEPTH + 5])
        value = _nested(rng, depth, 3)
        text = json.dumps(value)
        assert _depth(value) == depth
        if depth > MAX_DEPTH:
            with pytest.raises(ValueError, match=f"nested more than {MAX_DEPTH} levels"):
                parse_json(text)
        else:
            assert parse_json(text) == value, n
    assert parse_json("7") == 7 and parse_json("[]") == [] and parse_json('{"a": {}}') == {"a": {}}
