"""safetensors headers checked as the safetensors library reads them (issue 43): each rule of
`safetensors_in.check_header` on a real file of a real run — a model.safetensors, a shard of a
sharded model, a PEFT adapter — whose header is rewritten to break it, refused in one line naming
the file and the tensor or field; the shards' index checked against the shards; and the refusal
through the command line, nothing written. (tests/test_fuzz.py flips their bits.)"""

from __future__ import annotations

import json
import shutil
import struct
from pathlib import Path

import pytest
from conftest import checkpoints_of
from helpers import assert_one_line_error, tailor, write_recipe

from tailor_tui.checkpoints.model_layout import ModelFileLayout
from tailor_tui.errors import CheckpointError
from tailor_tui.formats.safetensors_in import safetensors_header, safetensors_tensors

# a file kind -> (the run, the file in its newest checkpoint)
FILES = {
    "model.safetensors": ("hf_bf16_2", "model.safetensors"),
    "shard": ("hf_sharded_safetensors", "model-00002-of-00004.safetensors"),
    "adapter": ("hf_peft_lora", "adapter_model.safetensors"),
}


def split(path: Path) -> tuple[bytes, bytes]:
    """(header's JSON bytes, the data after it)."""
    data = path.read_bytes()
    (length,) = struct.unpack("<Q", data[:8])
    return data[8: 8 + length], data[8 + length:]


def write(path: Path, raw: bytes, data: bytes) -> None:
    path.write_bytes(struct.pack("<Q", len(raw)) + raw + data)


def by_offset(header: dict) -> list[str]:
    return sorted((n for n in header if n != "__metadata__"), key=lambda n: header[n]["data_offsets"])


def edited(change):
    """A rewrite of the parsed header (`change(header)`, names by offset: what it says of itself)."""
    def rewrite(raw: bytes, data: bytes) -> tuple[bytes, bytes]:
        header = json.loads(raw)
        said = change(header, by_offset(header))
        return json.dumps(header, separators=(",", ":")).encode(), data, said
    return rewrite


def raw_edit(change):
    def rewrite(raw: bytes, data: bytes):
        header = json.loads(raw)
        return (*change(raw, data, by_offset(header)), None)
    return rewrite


def _set(name_at: int, field: str, value, needle: str):
    def change(header, names):
        header[names[name_at]][field] = value
        return [repr(names[name_at]), needle]
    return edited(change)


def _shift(by: int):
    """The last tensor's offsets moved `by` bytes (its size kept): a gap or an overlap."""
    def change(raw, data, names):
        header = json.loads(raw)
        last = header[names[-1]]["data_offsets"]
        header[names[-1]]["data_offsets"] = [last[0] + by, last[1] + by]
        return json.dumps(header).encode(), data + bytes(max(by, 0))
    return raw_edit(change)


def _metadata(value):
    def change(header, names):
        header["__metadata__"] = value
        return ["__metadata__"]
    return edited(change)


def _unsigned(header, names):
    """The first tensor's dtype made the unsigned one of its size (U16 for BF16: the library
    reads it, other values)."""
    info = header[names[0]]
    info["dtype"] = {"BF16": "U16", "F16": "U16", "F32": "U32", "F64": "U64", "I64": "U64"}[info["dtype"]]
    return [repr(names[0])]


def _twice(raw, data, names):
    entry = json.dumps({names[0]: json.loads(raw)[names[0]]})[1:-1]
    return b"{" + entry.encode() + b"," + raw[1:], data


# case -> (the rewrite, what the line says besides the file, whether the library itself refuses it:
# where it does not, it would read the file otherwise than it looks)
CASES = {
    "header not starting with {": (raw_edit(lambda raw, data, names: (b" " + raw, data)), ["starts with b' '"],
                                   False),
    "a tensor named twice": (raw_edit(_twice), ["twice"], False),
    "unknown dtype": (_set(0, "dtype", "Q8", "dtype 'Q8'"), [], True),
    "a dtype as a number": (_set(0, "dtype", 4, "dtype 4"), [], True),
    "a dtype the library knows, tailor-tui not": (edited(_unsigned), ["dtype 'U"], False),
    "shape not a list": (_set(0, "shape", "12", "shape '12'"), [], True),
    "a negative shape entry": (_set(0, "shape", [-1], "shape entry -1"), [], True),
    "a float shape entry": (_set(0, "shape", [2.0], "shape entry 2.0"), [], True),
    "a boolean shape entry": (_set(0, "shape", [True], "shape entry True"), [], True),
    "shape and dtype not fitting its bytes": (_set(0, "shape", [1], "do not fit"), [], True),
    "shape overflowing 64 bits": (_set(0, "shape", [1 << 62, 1 << 62, 0], "more elements than 2**64"), [], True),
    "three data offsets": (_set(0, "data_offsets", [0, 2, 4], "not two integers"), [], True),
    "a negative data offset": (_set(0, "data_offsets", [-4, 0], "data offset -4"), [], True),
    "end before start": (edited(lambda h, n: [h[n[0]].update(data_offsets=h[n[0]]["data_offsets"][::-1] or 0),
                                             repr(n[0]), "end before its start"][1:]), [], True),
    "a field missing": (edited(lambda h, n: [h[n[0]].pop("shape"), repr(n[0]), "['data_offsets', 'dtype']"][1:]),
                        [], True),
    "a field more": (edited(lambda h, n: [h[n[0]].update(z=[1]), repr(n[0]), "'z'"][1:]), [], False),
    "a gap before the last tensor": (_shift(2), ["a gap"], True),
    "the last tensor overlapping the one before": (_shift(-2), ["an overlap"], True),
    "bytes after the last tensor": (raw_edit(lambda raw, data, names: (raw, data + bytes(8))),
                                    ["bytes after the last tensor"], True),
    "the data truncated": (raw_edit(lambda raw, data, names: (raw, data[:-1])), ["(truncated)"], True),
    "__metadata__ mapping text to a number": (_metadata({"format": 1}), ["__metadata__['format']"], True),
    "__metadata__ a list": (_metadata(["pt"]), ["__metadata__ is list"], True),
    "__metadata__ null": (_metadata(None), ["__metadata__ is NoneType"], False),
    "NaN, which is not JSON": (raw_edit(lambda raw, data, names: (raw.replace(b'"shape":[', b'"shape":[NaN,', 1),
                                                                   data)), ["NaN"], True),
    "a lone surrogate in a name": (raw_edit(lambda raw, data, names: (raw.replace(b'"' + names[0].encode() + b'"',
                                                                                  b'"\\ud800"', 1), data)),
                                   ["lone surrogate"], True),
    "a header of invalid UTF-8": (raw_edit(lambda raw, data, names: (raw.replace(names[0].encode(), b"\xff", 1),
                                                                     data)), ["utf-8"], True),
    "a header longer than the file": (raw_edit(lambda raw, data, names: (raw, b"")), ["in a file of"], True),
}


@pytest.fixture(scope="module")
def originals(real_run) -> dict[str, Path]:
    found = {}
    for kind, (name, file) in FILES.items():
        run, spec = real_run(name)
        found[kind] = checkpoints_of(run, spec)[-1] / file
    return found


@pytest.mark.parametrize("kind", list(FILES))
@pytest.mark.parametrize("case", list(CASES))
def test_each_rule_of_a_header_is_refused_in_one_line_naming_file_and_tensor(originals, tmp_path, kind, case):
    from safetensors import SafetensorError, safe_open

    source = originals[kind]
    safetensors_header(source)  # the real file passes
    target = tmp_path / source.name
    rewrite, needles, library_refuses = CASES[case]
    raw, data = split(source)
    new_raw, new_data, said = rewrite(raw, data)
    write(target, new_raw, new_data)
    if case == "a header longer than the file":
        target.write_bytes(target.read_bytes()[: 8 + len(new_raw) - 1])
    with pytest.raises(CheckpointError) as refused:
        safetensors_header(target)
    line = str(refused.value)
    assert "\n" not in line and line.startswith(f"{target}: "), line
    for needle in [*needles, *(said or [])]:
        assert needle in line, (needle, line)
    try:
        with safe_open(str(target), "pt") as f:
            for name in f.keys():
                f.get_tensor(name)
        library = False
    except (SafetensorError, ValueError, TypeError):
        library = True
    assert library == library_refuses, case  # what tailor-tui is stricter than the library in, named


def test_every_real_header_passes_and_places_each_tensor_where_the_library_reads_it(originals):
    import torch
    from safetensors import safe_open

    for path in originals.values():
        places = safetensors_tensors(path)
        data = path.read_bytes()
        with safe_open(str(path), "pt") as f:
            assert sorted(f.keys()) == sorted(places)
            for name, (_dtype, shape, begin, end) in places.items():
                tensor = f.get_tensor(name)
                assert tuple(tensor.shape) == shape
                assert tensor.reshape(-1).view(torch.uint8).numpy().tobytes() == data[begin:end]


@pytest.fixture
def sharded(real_run, tmp_path) -> Path:
    run, spec = real_run("hf_sharded_safetensors")
    copy = tmp_path / "run"
    shutil.copytree(run, copy, symlinks=True)
    return copy


def _edit_index(folder: Path, change) -> Path:
    index = folder / "model.safetensors.index.json"
    data = json.loads(index.read_text())
    change(data["weight_map"])
    index.write_text(json.dumps(data, indent=2))
    return index


@pytest.mark.parametrize(("change", "needle"), [
    (lambda m: m.update({k: next(v2 for v2 in sorted(set(m.values())) if v2 != v) for k, v in [min(m.items())]}),
     "maps tensor"),
    (lambda m: m.pop(min(m)), "does not map tensor"),
    (lambda m: m.update({"lm_head.extra": min(m.values())}), "'lm_head.extra'"),
])
def test_an_index_disagreeing_with_its_shards_is_refused(sharded, tmp_path, change, needle):
    """The index goes to the output as the base's: it must say where each tensor is (loaders
    open the shard it names)."""
    base = sorted(sharded.glob("checkpoint-*"), key=lambda p: int(p.name.split("-")[1]))[-1]
    ModelFileLayout.of_files(tuple(sorted(base.glob("model-*.safetensors"))))  # the real index passes
    index = _edit_index(base, change)
    with pytest.raises(CheckpointError) as refused:
        ModelFileLayout.of_files(tuple(sorted(base.glob("model-*.safetensors"))))
    line = str(refused.value)
    assert "\n" not in line and line.startswith(f"{index}: ") and needle in line, line


def test_a_recorded_header_is_checked_as_a_file_s(originals, tmp_path):
    """A partial save records its model files' headers (`tailor_model_files.json`): one with a gap
    between its tensors is refused, as the file would be."""
    layout = ModelFileLayout.of_files((originals["model.safetensors"],))
    record = json.loads(layout.to_json())
    header = json.loads(record["files"]["model.safetensors"])
    last = by_offset(header)[-1]
    header[last]["data_offsets"] = [o + 2 for o in header[last]["data_offsets"]]
    record["files"]["model.safetensors"] = json.dumps(header)
    path = tmp_path / "tailor_model_files.json"
    path.write_text(json.dumps(record))
    with pytest.raises(CheckpointError, match=f"{last}.*a gap"):
        ModelFileLayout.read(path)


def _rewrite_file(path: Path, case: str) -> None:
    raw, data = split(path)
    new_raw, new_data, _said = CASES[case][0](raw, data)
    write(path, new_raw, new_data)


@pytest.mark.parametrize(("where", "case"), [("source", "bytes after the last tensor"),
                                             ("base", "a tensor named twice"),
                                             ("source", "the last tensor overlapping the one before")])
def test_a_refused_header_stops_apply_in_one_line_and_nothing_is_written(real_run, tmp_path, where, case):
    run, spec = real_run("hf_bf16_2")
    copy = tmp_path / "run"
    shutil.copytree(run, copy, symlinks=True)
    _c2, c4, c6 = checkpoints_of(copy, spec)
    target = (c4 if where == "source" else c6) / "model.safetensors"
    _rewrite_file(target, case)
    recipe = write_recipe(tmp_path, c6, {"layers.1": c4})
    assert_one_line_error(tailor("--apply", recipe), 4, str(target), *CASES[case][1])
    assert not (tmp_path / "composed").exists()


def test_a_sharded_base_whose_index_disagrees_stops_apply(sharded, tmp_path):
    spec_run = sorted(sharded.glob("checkpoint-*"), key=lambda p: int(p.name.split("-")[1]))
    base, other = spec_run[-1], spec_run[0]
    index = _edit_index(base, lambda m: m.pop(min(m)))
    recipe = write_recipe(tmp_path, base, {"layers.1": other})
    assert_one_line_error(tailor("--apply", recipe), 4, str(index), "does not map tensor")
    assert not (tmp_path / "composed").exists()
