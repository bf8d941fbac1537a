"""Fuzzed, not only spot-checked (issue 43): every bit of the zip metadata of each torch file kind a
run holds — the central directory, the end records, each local header and data descriptor — is
flipped in turn (a seeded sample where a file has more than MAX_BITS such bits), and the file is
read the way every path of tailor-tui reads one before trusting or copying it (`check_crcs`, read
whole and streamed, and `read_structure`). Each mutation must end either in a one-line
CheckpointError, or, where tailor-tui accepts the file, in a file torch's own reader loads to the
same values as the original (the flipped bit is one nobody reads: a time stamp, alignment padding).
Never another exception, never an accepted file torch cannot load or reads otherwise.

The composition in full (the real command line) meets the same mutations in tests/test_zip_records.py;
here the readers run in-process so that thousands of mutations take seconds. The counts and the
time are printed (`pytest -s`); TAILOR_FUZZ_BITS raises the sample (a nightly variant).
"""

from __future__ import annotations

import os
import random
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
        try:
            read_as_tailor(target, kind.endswith("_states"))
        except CheckpointError as exc:
            line = str(exc)
            assert "\n" not in line and str(target) in line, (at, bit, line)
            refused += 1
            messages.add(line.split(": ", 2)[-1][:40])
            continue
        except Exception as exc:  # noqa: BLE001 (any other exception is the failure looked for)
            pytest.fail(f"byte {at} bit {bit}: {type(exc).__name__}: {exc}")
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
