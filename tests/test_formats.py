"""torch's two file formats and the DeepSpeed releases tailor-tui reads.

Legacy-format (non-zip) files as DeepSpeed writes them (`checkpoint_serialization:
false`) and as LLMTailor writes optim files (a real one re-saved with
`_use_new_zipfile_serialization=False`) compose as base and as source and verify; the
output is always zip-format. Damaged files say which format they failed as; checkpoints
of releases outside the supported range say which release they are from.
"""

from __future__ import annotations

import collections
import io
import math
import pickle
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
import torch
from conftest import checkpoints_of, tree_digest
from helpers import (
    TAILOR,
    apply_and_verify,
    assert_one_line_error,
    assert_optim_states_equal,
    assert_rows_from_picks,
    tailor,
    two_checkpoint_picks,
    write_recipe,
)
from runs import resume_and_step

from tailor_tui.formats.ds_format import SUPPORTED
from tailor_tui.formats.pickled import read_pickle, read_pickle_from
from tailor_tui.formats.ptfile import read_structure
from tailor_tui.formats.ptpickle import dumps
from tailor_tui.formats.ptwrite import write_archive
from tailor_tui.formats.safe_load import enum_member as safe_enum_member
from tailor_tui.formats.safe_load import load_pt

ZIP, LEGACY = b"PK\x03\x04", b"\x80\x02\x8a\x0a"


def starts(path: Path) -> bytes:
    with open(path, "rb") as f:
        return f.read(4)


def test_deepspeed_legacy_serialization_composes_verifies_and_resumes(real_run, tmp_path):
    run, spec = real_run("ds_legacy_serialization")
    oldest, _, newest = checkpoints_of(run, spec)
    assert {starts(f) for f in run.rglob("*.pt")} == {LEGACY}  # DeepSpeed wrote every file so
    scanned = subprocess.run(  # structure is read without torch in this format too
        [sys.executable, "-c", "import sys; from tailor_tui.checkpoints.scan import scan; "
         f"r = scan({str(run)!r}); assert len(r.checkpoints) == 3, r.problems; "
         "assert 'torch' not in sys.modules"], capture_output=True, text=True)
    assert scanned.returncode == 0, scanned.stderr
    picks = two_checkpoint_picks(spec, oldest)
    recipe = write_recipe(tmp_path, newest, picks)
    before = tree_digest(run)
    applied = tailor("--apply", recipe, "-j", "2")
    assert applied.returncode == 0, applied.stderr
    verified = tailor("--verify", recipe)
    assert verified.returncode == 0, verified.stdout + verified.stderr
    assert tree_digest(run) == before
    out = tmp_path / "composed"
    assert {starts(f) for f in out.rglob("*.pt")} == {ZIP}  # the output is always zip-format
    assert_rows_from_picks(out, picks, newest)

    losses = resume_and_step(out, spec, tmp_path / "resume")
    assert losses and all(math.isfinite(x) for x in losses)
    assert_optim_states_equal(out, tmp_path / "resume" / "resaved")


@pytest.fixture
def llmtailor_style(real_run, tmp_path):
    """A copy of a real run whose step-4 optim files are re-saved in the legacy format."""
    run, spec = real_run("ds_bf16_3_subgroups")
    copy = tmp_path / "run"
    shutil.copytree(run, copy)
    legacy = checkpoints_of(copy, spec)[1]
    for f in legacy.glob("*optim_states.pt"):
        torch.save(torch.load(f, weights_only=False), f, _use_new_zipfile_serialization=False)
        assert starts(f) == LEGACY
    return copy, spec, legacy


def test_legacy_optim_files_compose_as_a_source(llmtailor_style, tmp_path):
    run, spec, legacy = llmtailor_style
    c2, _, c6 = checkpoints_of(run, spec)
    picks = {"layers.1": legacy, "layers.3": legacy, "embed_tokens": c2}
    apply_and_verify(write_recipe(tmp_path, c6, picks))
    assert_rows_from_picks(tmp_path / "composed", picks, c6)


def test_a_source_whose_records_lie_elsewhere_in_its_files_composes_bit_exactly(real_run, tmp_path):
    """A source's optim files re-saved under another archive name: their records hold the same
    tensors at other offsets, and are read in step with the base's at that distance (each chunk
    checked and counted where it lies, the slices taken copied from there)."""
    run, spec = real_run("ds_bf16_3_subgroups")
    copy = tmp_path / "run"
    shutil.copytree(run, copy)
    c2, _, c6 = checkpoints_of(copy, spec)
    for f in c2.glob("*optim_states.pt"):
        renamed = f.with_name("a_much_longer_archive_name_than_deepspeed_gives.pt")
        torch.save(torch.load(f, weights_only=False), renamed)
        renamed.replace(f)
        with zipfile.ZipFile(f) as z, zipfile.ZipFile(next(c6.glob(f"*{f.name[-30:]}"))) as theirs:
            assert z.infolist()[-1].header_offset != theirs.infolist()[-1].header_offset
    picks = {"layers.1": c2, "layers.2": c2, "lm_head": c2}
    apply_and_verify(write_recipe(tmp_path, c6, picks), "-j", "2")
    assert_rows_from_picks(tmp_path / "composed", picks, c6)


def test_legacy_optim_files_compose_as_the_base(llmtailor_style, tmp_path):
    run, spec, legacy = llmtailor_style
    c2, _, c6 = checkpoints_of(run, spec)
    picks = {"layers.0": c6, "layers.1": c2, "norm": c6}
    apply_and_verify(write_recipe(tmp_path, legacy, picks), "-j", "2")
    out = tmp_path / "composed"
    assert {starts(f) for f in out.rglob("*.pt")} == {ZIP}
    assert_rows_from_picks(out, picks, legacy)
    losses = resume_and_step(out, spec, tmp_path / "resume")
    assert losses and all(math.isfinite(x) for x in losses)
    assert_optim_states_equal(out, tmp_path / "resume" / "resaved")


def test_a_damaged_file_says_which_format_it_failed_as(llmtailor_style, real_run, tmp_path):
    run, spec, legacy = llmtailor_style
    c2, _, c6 = checkpoints_of(run, spec)
    recipe = write_recipe(tmp_path, c6, {"layers.1": legacy})
    optim = next(legacy.glob("*rank_1_*optim_states.pt"))
    whole = optim.read_bytes()

    optim.write_bytes(whole[: len(whole) - 1000])  # cut inside the storages' data
    assert_one_line_error(tailor("--apply", recipe, "--dry-run"), 4, optim.name,
                          "legacy-format (non-zip) torch file", "truncated")
    optim.write_bytes(whole + b"\0" * 8)
    assert_one_line_error(tailor("--apply", recipe), 4, optim.name, "legacy-format", "after its last storage")
    optim.write_bytes(b"\0" * 64)
    assert_one_line_error(tailor("--apply", recipe), 4, optim.name,
                          "neither a zip-format nor a legacy-format torch file")
    optim.write_bytes(whole)
    zipped = next(c2.glob("*rank_2_*optim_states.pt"))
    zipped.write_bytes(zipped.read_bytes()[:-200])
    recipe = write_recipe(tmp_path, c6, {"layers.1": c2})
    assert_one_line_error(tailor("--apply", recipe), 4, zipped.name, "zip-format torch file", "truncated")
    assert not (tmp_path / "composed").exists()


def _rewrite_model_states(ckpt: Path, **changes) -> None:
    for f in ckpt.glob("*model_states.pt"):
        states = torch.load(f, weights_only=False)
        states.update(changes)
        torch.save(states, f)


@pytest.mark.parametrize("version, says", [
    ("0.12.6", "older than tailor-tui reads"),
    ("0.20.0", "newer than this tailor-tui reads"),
])
def test_a_release_outside_the_range_is_named(real_run, tmp_path, version, says):
    run, spec = real_run("hf_bf16_2")
    c2, _, c6 = checkpoints_of(run, spec)
    other = tmp_path / "checkpoint-2"
    shutil.copytree(c2, other)
    _rewrite_model_states(other / "global_step2", ds_version=version)
    recipe = write_recipe(tmp_path, c6, {"layers.1": other})
    result = tailor("--apply", recipe, "--dry-run")
    assert_one_line_error(result, 4, "model_states.pt", f"DeepSpeed {version}", SUPPORTED, says)
    # a class that release pickled but tailor-tui does not know: still the release, not "unsafe"
    _rewrite_model_states(other / "global_step2", ds_version=version, extra=collections.Counter(a=1))
    result = tailor("--apply", recipe, "--dry-run")
    assert_one_line_error(result, 4, f"DeepSpeed {version}", SUPPORTED)
    assert "unsafe" not in result.stderr


def test_sets_are_read_as_names_only():
    names = pickle.dumps({"sparse_tensor_module_names": {"embed", "lm_head"}}, protocol=2)
    assert read_pickle(names) == {"sparse_tensor_module_names": {"embed", "lm_head"}}
    for hostile in ({("a", 1)}, {frozenset()}):
        with pytest.raises(pickle.UnpicklingError):
            read_pickle(pickle.dumps({"sparse_tensor_module_names": hostile}, protocol=2))


class _ByName:
    """Pickles as early Python 3.11 releases pickle an enum member: `getattr(cls, name)`."""

    def __init__(self, cls, name):
        self.cls, self.name = cls, name

    def __reduce_ex__(self, protocol):
        return getattr, (self.cls, self.name)


def _getattr_pickle(module: str, qualname: str, name) -> bytes:
    """`getattr(module.qualname, name)` pickled by Python's own pickler, protocol 2 (as torch.save)."""
    import importlib

    return pickle.dumps(_ByName(getattr(importlib.import_module(module), qualname), name), protocol=2)


ZERO_STAGE = ("deepspeed.runtime.zero.config", "ZeroStageEnum")


def test_an_enum_member_pickled_by_name_is_read_and_written_back_so(tmp_path):
    from deepspeed.runtime.zero.config import ZeroStageEnum

    data = _getattr_pickle(*ZERO_STAGE, "weights")
    assert pickle.loads(data) is ZeroStageEnum.weights  # what Python makes of it
    member = read_pickle(data)
    assert member == 3 and member.name == "weights"
    assert dumps(member)[0] == data  # byte for byte
    # a torch file holding it: the torch-free reader and torch.load (load_pt) read it alike
    path = tmp_path / "optim.pt"
    write_archive(path, archive="optim", pickle=dumps({"zero_stage": member})[0], storages=[])
    assert read_structure(path)[0]["zero_stage"].name == "weights"
    assert load_pt(path)["zero_stage"] is ZeroStageEnum.weights
    assert safe_enum_member(ZeroStageEnum, "gradients") is ZeroStageEnum.gradients


@pytest.mark.parametrize("module, qualname, name", [
    (*ZERO_STAGE, "max_stage"),  # an alias: Python pickles a member under its own name
    (*ZERO_STAGE, "__class__"),
    (*ZERO_STAGE, "_missing_"),
    (*ZERO_STAGE, 3),
    ("collections", "OrderedDict", "fromkeys"),  # an allowed class, but no enumeration
    ("deepspeed.runtime.fp16.loss_scaler", "LossScaler", "__init__"),
    ("torch", "Size", "count"),
])
def test_getattr_is_honoured_for_nothing_but_a_member_by_name(module, qualname, name):
    for unhashable in ([], {}):  # not a class at all
        with pytest.raises(pickle.UnpicklingError, match="not a member of a DeepSpeed enumeration"):
            read_pickle(pickle.dumps(_ByName(unhashable, name), protocol=2))
    with pytest.raises(pickle.UnpicklingError, match="not a member of a DeepSpeed enumeration"):
        read_pickle(_getattr_pickle(module, qualname, name))
    import importlib

    cls = getattr(importlib.import_module(module), qualname)  # torch.load's rule (load_pt) is the same
    with pytest.raises(pickle.UnpicklingError, match="not a member of a DeepSpeed enumeration"):
        safe_enum_member(cls, name)


def test_a_pickle_claiming_a_huge_string_is_refused_without_allocating_it():
    claim = b"\x80\x02X" + (2**31 - 1).to_bytes(4, "little") + b"abc"  # BINUNICODE of 2 GiB
    with pytest.raises(pickle.UnpicklingError, match="larger than"):
        read_pickle_from(io.BytesIO(claim))


@pytest.mark.parametrize("base_format", ["zip", "legacy"])  # streamed; re-serialised by torch
def test_a_source_with_other_optimizer_state_dtypes_is_refused(llmtailor_style, tmp_path, base_format):
    run, spec, legacy = llmtailor_style
    c2, _, c6 = checkpoints_of(run, spec)
    base = c6 if base_format == "zip" else legacy
    for f in c2.glob("*optim_states.pt"):  # as saved with bf16 optimizer states: same names, bf16 flats
        state = torch.load(f, weights_only=False)
        inner = state["optimizer_state_dict"]
        inner["fp32_flat_groups"] = [t.to(torch.bfloat16) for t in inner["fp32_flat_groups"]]
        torch.save(state, f)
    recipe = write_recipe(tmp_path, base, {"layers.1": c2})
    result = tailor("--apply", recipe, "-j", "1")
    assert_one_line_error(result, 5, "optim_states.pt", "sub-group", "stored as bfloat16, the base's as float32")
    assert not (tmp_path / "composed").exists() and not [p for p in tmp_path.iterdir() if p.name.startswith(".")]


def test_a_memo_bomb_is_refused_in_little_memory(real_run, tmp_path):
    run, spec = real_run("hf_bf16_2")
    c2, _, c6 = checkpoints_of(run, spec)
    bad = tmp_path / "checkpoint-2"
    shutil.copytree(c2, bad)
    target = bad / "global_step2" / "zero_pp_rank_0_mp_rank_00_model_states.pt"
    bomb = b"\x80\x02}r" + (400_000_000).to_bytes(4, "little") + b"."  # LONG_BINPUT 400000000
    with zipfile.ZipFile(c2 / "global_step2" / target.name) as z, \
            zipfile.ZipFile(target, "w", zipfile.ZIP_STORED) as out:
        for info in z.infolist():
            out.writestr(info, bomb if info.filename.endswith("/data.pkl") else z.read(info))
    recipe = write_recipe(tmp_path, c6, {"layers.1": bad})
    measured = subprocess.run(
        [sys.executable, "-c", "import resource, subprocess, sys; "
         "r = subprocess.run(sys.argv[1:], capture_output=True, text=True); "
         "print(r.returncode, resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss); "
         "print(r.stderr, file=sys.stderr)", TAILOR, "--apply", str(recipe), "--dry-run"],
        capture_output=True, text=True)
    code, peak_kib = map(int, measured.stdout.split())
    errors = [line for line in measured.stderr.splitlines() if line.startswith("error: ")]
    assert code == 4 and len(errors) == 1 and "Traceback" not in measured.stderr, measured.stderr
    assert target.name in errors[0] and "memo index 400000000" in errors[0]
    assert peak_kib < 256 * 1024, f"peak RSS {peak_kib} KiB"


def test_structure_bounds_nesting_and_negative_offsets():
    from tailor_tui.errors import CheckpointError
    from tailor_tui.formats.pickled import StorageRef, TensorRef
    from tailor_tui.formats.ptfile import Record, locate

    deep = b"\x80\x02" + b"(" * 200 + b"."  # 200 open MARKs
    with pytest.raises(pickle.UnpicklingError, match="nested more than"):
        read_pickle(deep)
    record = Record("archive/data/0", 0, 64, 400, 0, ())
    storage = StorageRef("0", 4, 100, "FloatStorage")
    assert locate(TensorRef(storage, 10, (90,), (1,)), {"archive/data/0": record}, "archive/").offset == 104
    for offset, size in ((-1, 10), (95, 10)):
        with pytest.raises(CheckpointError, match="outside its record"):
            locate(TensorRef(storage, offset, (size,), (1,)), {"archive/data/0": record}, "archive/")


def test_ranks_with_the_same_structure_share_one_built_object(real_run):
    """read_structure(shared=True): the ranks of one checkpoint pickle their optim file's structure
    byte for byte the same, so it is built once per process; what each gives is what an unshared read
    gives, and each file keeps its own records."""
    from tailor_tui.checkpoints.checkpoint import open_checkpoint
    from tailor_tui.formats.ptfile import read_structure
    from tailor_tui.kinds.zero import flat_tensor_bytes

    run, spec = real_run("hf_bf16_2")
    ckpt = checkpoints_of(run, spec)[-1]
    files = sorted(ckpt.glob("*/*optim_states.pt"))
    assert len(files) == 2
    first, second = (read_structure(f, shared=True) for f in files)
    assert first[0] is second[0]
    assert first[1] != second[1]  # each rank file's own records (names, offsets, CRC-32s)
    sizes = tuple(open_checkpoint(ckpt).layout.group_sizes())
    for f, got in zip(files, (first, second)):
        alone = read_structure(f)
        assert alone[0] is not got[0]  # an unshared read builds its own
        assert flat_tensor_bytes(*got, f, sizes) == flat_tensor_bytes(*alone, f, sizes)
