"""Fuzzed through the whole composition (issue 43): the in-process fuzz (tests/test_fuzz.py) flips
thousands of bits and reads each file as every path of tailor-tui reads it; here a seeded sample of
those mutations goes through the real command (`tailor_tui.cli.main.main`, in this process, one
worker: the composition, its CLI error mapping and `--verify`, without a process start each).

Each mutated run must end in either
- a one-line refusal (`error: ...`, exit 4, or 5 where the file no longer fits the model, naming the
  mutated file; exit 3 naming its checkpoint where a partial save's record no longer lists a row the
  recipe takes from it) and nothing at the output, or
- exit 0, an output that `--verify` proves, and every torch file of the output loading (torch's own
  reader) to the same values as the output composed from the untouched run.
Never an internal error, never a published file torch (or the safetensors library) cannot load or reads
otherwise. The counts
and the time are printed (`pytest -s`); TAILOR_FUZZ_COMPOSE raises the sample (a nightly variant).
"""

from __future__ import annotations

import os
import random
import shutil
import time
from pathlib import Path

import pytest
import torch
from helpers import write_recipe
from safetensors.torch import load_file
from test_fuzz import KINDS, metadata_bytes, same

from tailor_tui.cli.main import main

SAMPLE = int(os.environ.get("TAILOR_FUZZ_COMPOSE", 60))  # mutations per file kind


def spots(name: str, data: bytes) -> list[int]:
    """The bytes of a file's metadata: a zip archive's (see test_fuzz), a safetensors file's length and header."""
    if name.endswith(".safetensors"):
        return list(range(8 + int.from_bytes(data[:8], "little")))
    if name.endswith(".json"):
        return list(range(len(data)))
    return metadata_bytes(data)


def torch_files(out: Path) -> dict[str, object]:
    """Every torch file of an output, loaded by torch's own reader."""
    files = {str(p.relative_to(out)): torch.load(p, weights_only=False) for p in sorted(out.rglob("*"))
             if p.suffix in (".pt", ".pth", ".bin") and p.is_file()}
    return files | {str(p.relative_to(out)): load_file(p) for p in sorted(out.rglob("*.safetensors"))}


def compose(recipe: Path, capsys) -> tuple[int, str]:
    code = main(["--apply", str(recipe), "--workers", "1", "--no-fsync", "--progress", "lines"])
    return code, capsys.readouterr().err


# (run, folder in its cache entry, base, {row: source}, the file mutated, mutations): each file kind
# tailor-tui reads; a partial save is the base (its record, its recorded model-file headers, a rank's rows
# and optimizer skeleton all read), the rows it did not save from the full save before it
UNSAVED = ("embed_tokens", "layers.1", "layers.3")  # what the parity strategy left out at step 4
CASES = {
    **{kind: ("hf_bf16_2", ".", "checkpoint-6", {"layers.1": "checkpoint-2"}, KINDS[kind], SAMPLE) for kind in KINDS},
    "model.safetensors": ("hf_bf16_2", ".", "checkpoint-6", {"layers.1": "checkpoint-2"},
                          "checkpoint-6/model.safetensors", SAMPLE),
    "pytorch_model.bin": ("hf_bin", ".", "checkpoint-4", {"layers.1": "checkpoint-2"}, "checkpoint-4/pytorch_model.bin",
                          SAMPLE),
    **{f"partial save: {name}": ("hf_selective_parity", "run", "partial-step4", dict.fromkeys(UNSAVED, "checkpoint-2"),
                                 f"partial-step4/{name}", SAMPLE // 3)
       for name in ("global_step4/tailor_rows_rank_1.safetensors", "global_step4/tailor_optim_skeleton_rank_1.pt",
                    "tailor_partial.json", "tailor_model_files.json")},
}


@pytest.mark.parametrize("kind", list(CASES))
def test_a_flipped_bit_composes_correctly_or_is_refused_in_one_line(real_run, tmp_path, kind, capsys):
    name, folder, base, layers, mutated_file, sample = CASES[kind]
    run = tmp_path / "run"
    shutil.copytree(real_run(name)[0] / folder, run)
    recipe = write_recipe(tmp_path, run / base, {row: run / src for row, src in layers.items()})
    out = tmp_path / "composed"
    assert compose(recipe, capsys)[0] == 0
    expected = torch_files(out)
    target = run / mutated_file
    original = target.read_bytes()
    bits = random.Random(4343).sample([(at, bit) for at in spots(mutated_file, original) for bit in range(8)], sample)
    began, refused, composed = time.monotonic(), 0, 0
    for at, bit in bits:
        shutil.rmtree(out, ignore_errors=True)
        mutated = bytearray(original)
        mutated[at] ^= 1 << bit
        target.write_bytes(mutated)
        code, err = compose(recipe, capsys)
        where = f"byte {at} bit {bit} of {kind}"
        if code != 0:
            lines = [line for line in err.splitlines() if line.startswith("error: ")]
            assert code in (3, 4, 5) and len(lines) == 1 and "Traceback" not in err, (where, code, err)
            blamed = target if code != 3 else target.parent.name  # a record's rows: the recipe asks what it lacks
            assert str(blamed) in lines[0] and "internal error" not in lines[0], (where, err)
            assert not out.exists(), where
            refused += 1
            continue
        composed += 1
        assert main(["--verify", str(recipe)]) == 0, (where, capsys.readouterr())
        capsys.readouterr()
        loaded = torch_files(out)
        assert loaded.keys() == expected.keys(), where
        for name, value in loaded.items():
            if name.endswith(".safetensors") and value.keys() != expected[name].keys():
                # a name flipped into another the header may hold (`input_layernorm` -> `i~put_layernorm`,
                # still under its row's module): carried with its row as the base holds it, values equal
                held = set(load_file(target))
                assert value.keys() - expected[name].keys() <= held, where
                assert not (expected[name].keys() - value.keys()) & held, where
                value, want = ({k: d[k] for k in value.keys() & expected[name].keys()} for d in (value, expected[name]))
                assert same(value, want), f"{where}: accepted, but the library reads other values in {name}"
                continue
            assert same(value, expected[name]), f"{where}: accepted, but torch reads other values in {name}"
    target.write_bytes(original)
    print(f"\n{kind}: {len(bits)} mutations composed in {time.monotonic() - began:.1f}s: {refused} refused in "
          f"one line, {composed} composed and verified (torch loads the same values)")
    assert refused  # the sample reaches bits that matter: the test can fail either way
