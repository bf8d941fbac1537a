"""Corruption is refused, never blessed: every byte the output takes from the base or a
source is checked against the CRC-32 its archive stores, during the composition, before
anything is published (torch.load itself never checks them)."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch
from conftest import checkpoints_of
from helpers import (
    as_if_rotted_in_place,
    assert_one_line_error,
    assert_rows_from_picks,
    flat_record,
    flip_byte,
    tailor,
    write_recipe,
)

from tailor_tui.errors import CheckpointError


@pytest.fixture
def run_copy(real_run, tmp_path):
    run, spec = real_run("ds_bf16_3_subgroups")
    copy = tmp_path / "run"
    shutil.copytree(run, copy)
    return checkpoints_of(copy, spec)


EVERY_ROW = ("embed_tokens", "layers.0", "layers.1", "layers.2", "layers.3", "norm", "lm_head")


@pytest.mark.parametrize("where", ["source", "base"])
def test_a_flipped_bit_in_an_optim_file_is_refused(run_copy, tmp_path, where):
    c2, c4, c6 = run_copy
    target = next((c2 if where == "source" else c6).glob("*rank_1_*optim_states.pt"))
    # anywhere in the record: a source's record is checked whole, not only the slices taken
    record = flip_byte(target, flat_record(target), where=0.999)
    # every row from step 2 (then every sub-group's record of the source is taken from), the base's state; of a
    # rotten base, one small row (records the output replaces whole are not read: the test below)
    recipe = write_recipe(tmp_path, c6, {r: c2 for r in (EVERY_ROW if where == "source" else ["norm"])})
    result = tailor("--apply", recipe, "-j", "2")
    assert_one_line_error(result, 4, target.name, f"record {record} fails its CRC-32 check", "re-copy it")
    assert not (tmp_path / "composed").exists()
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]


def test_a_base_record_the_output_replaces_whole_is_not_read_and_its_rot_not_carried(run_copy, tmp_path):
    """Every row taken from another checkpoint: every byte of the base's flat tensors' records is replaced
    (rows, and padding by zeros), so none of them is read: a flipped bit there is neither carried nor a reason
    to refuse, and their CRC-32s are worked out from what replaces them. The output holds the other
    checkpoint's flat tensors exactly, passes --verify and every record's CRC-32, and is the same bytes
    whether the base's record is sound or not."""
    import zipfile

    c2, _c4, c6 = run_copy
    outputs = {}
    for state in ("sound", "rotten"):
        if state == "rotten":
            target = next(c6.glob("*rank_1_*optim_states.pt"))
            flip_byte(target, flat_record(target), where=0.5)
        recipe = write_recipe(tmp_path, c6, {r: c2 for r in EVERY_ROW}, output=state)
        result = tailor("--apply", recipe, "-j", "2")
        assert result.returncode == 0, result.stderr
        outputs[state] = {f.name: f.read_bytes() for f in sorted((tmp_path / state).glob("*/*.pt"))}
        if state == "sound":
            verified = tailor("--verify", recipe)
            assert verified.returncode == 0, verified.stdout + verified.stderr
    assert outputs["rotten"] == outputs["sound"] and len(outputs["sound"]) == 6
    for f in (tmp_path / "rotten").glob("*/*optim_states.pt"):
        with zipfile.ZipFile(f) as z:
            assert z.testzip() is None, f  # every record's CRC-32 as stored
    assert_rows_from_picks(tmp_path / "rotten", {r: c2 for r in EVERY_ROW}, c6)  # (DeepSpeed's padding: not zeros)


def test_a_flipped_bit_in_a_file_copied_whole_is_refused(run_copy, tmp_path):
    c2, c4, c6 = run_copy
    target = next(c6.glob("*rank_0_*model_states.pt"))
    record = flip_byte(target, "data.pkl", where=0.9)
    recipe = write_recipe(tmp_path, c6, {"layers.0": c2})
    assert_one_line_error(tailor("--apply", recipe), 4, target.name, f"record {record} fails its CRC-32")


@pytest.mark.parametrize("small", [None, 0])
def test_every_record_of_a_file_is_checked_read_whole_or_streamed(run_copy, small):
    """`check_crcs` reads a small file whole and checks it in memory (`small`: None), a larger one
    record by record (0: as if every file were large): both pass a sound file, both name the record
    of a flipped bit, and both show `inspect` every byte of every record."""
    from tailor_tui.formats.ptfile import check_crcs
    from tailor_tui.formats.zipdir import read_directory

    _c2, _c4, c6 = run_copy
    for target in sorted(c6.glob("*rank_1_*.pt")):
        seen = []
        check_crcs(target, lambda at, chunk, seen=seen: seen.append(len(chunk)), small=small)
        assert sum(seen) == sum(e.size for e in read_directory(target))
        for suffix in ("data.pkl", flat_record(target)):
            copy = target.with_name(f"flipped-{suffix.replace('/', '-')}-{target.name}")
            shutil.copy(target, copy)
            record = flip_byte(copy, suffix, where=0.7)
            with pytest.raises(CheckpointError, match=f"record {record} fails its CRC-32 check"):
                check_crcs(copy, small=small)
            copy.unlink()


def test_verify_refuses_a_corrupt_source(run_copy, tmp_path):
    c2, c4, c6 = run_copy
    recipe = write_recipe(tmp_path, c6, {r: c2 for r in ("embed_tokens", "layers.0", "layers.1", "layers.2",
                                                         "layers.3", "norm", "lm_head")})
    assert tailor("--apply", recipe).returncode == 0
    target = next(c2.glob("*rank_2_*optim_states.pt"))
    flip_byte(target, flat_record(target), where=0.01)
    changed = tailor("--verify", recipe)  # the flip is a write: the source is not what was composed from
    assert changed.returncode == 7 and f"{target}: changed since the composition" in changed.stdout, changed.stdout
    as_if_rotted_in_place(tmp_path / "composed", target)  # bit rot: the same identity, a byte that fails its CRC
    result = tailor("--verify", recipe)
    assert result.returncode == 7 and "fails its CRC-32 check" in result.stdout, result.stdout + result.stderr


def test_a_partial_base_checks_the_full_sources_it_copies_from(real_run, tmp_path):
    run, spec = real_run("ds_selective_parity")
    copy = tmp_path / "sel"
    shutil.copytree(run / "run", copy)
    full = copy / "global_step2"
    target = next(full.glob("*rank_1_*optim_states.pt"))
    record = flip_byte(target, flat_record(target), where=0.5)
    rows = ("embed_tokens", "layers.0", "layers.1", "layers.2", "layers.3", "norm", "lm_head")
    recipe = write_recipe(tmp_path, copy / "partial-step6", {r: full for r in rows})
    assert_one_line_error(tailor("--apply", recipe), 4, target.name, f"record {record} fails its CRC-32 check")
    assert not (tmp_path / "composed").exists()


# --- a stricter --verify: bytes, not values, and the whole state -----------------------------


def _composed(real_run, tmp_path, name="hf_bf16_2"):
    """Step 4 as the base (its learning rate is not yet 0), two rows from step 2."""
    run, spec = real_run(name)
    c2, c4, c6 = checkpoints_of(run, spec)
    recipe = write_recipe(tmp_path, c4, {"layers.1": c2, "embed_tokens": c2})
    applied = tailor("--apply", recipe)
    assert applied.returncode == 0, applied.stderr
    return recipe, tmp_path / "composed", (c2, c4, c6)


def _resave(path: Path, change) -> None:
    state = torch.load(path, weights_only=False)
    change(state)
    torch.save(state, path)


def test_verify_catches_a_changed_learning_rate(real_run, tmp_path):
    recipe, out, _ = _composed(real_run, tmp_path)
    optim = next(out.glob("*/*rank_1_*optim_states.pt"))

    def lr_times_ten(state):
        group = state["optimizer_state_dict"]["optimizer_state_dict"]["param_groups"][0]
        assert group["lr"] > 0
        group["lr"] *= 10

    _resave(optim, lr_times_ten)
    result = tailor("--verify", recipe)
    assert result.returncode == 7
    assert "rank 1: optimizer state ['optimizer_state_dict']['optimizer_state_dict']['param_groups'][0]['lr'] " \
           "is not the base's" in result.stdout


def test_verify_compares_bytes_negative_zero_is_not_zero(real_run, tmp_path):
    recipe, out, _ = _composed(real_run, tmp_path, "hf_fp32_3_tied")  # 3 ranks: padded parameters
    from tailor_tui.planning.build import build_plan
    from tailor_tui.planning.recipe_file import load_recipe

    layout = build_plan(load_recipe(recipe), check_output=False).base.layout
    rank = layout.world_size - 1  # the last rank holds the padding
    slot = next(s for s in layout.slots if s.valid(rank) < s.part)
    optim = next(out.glob(f"*/*rank_{rank}_*optim_states.pt"))

    def negative_zero_in_padding(state):
        with torch.no_grad():
            state["optimizer_state_dict"]["fp32_flat_groups"][slot.group][slot.offset + slot.valid(rank)] = -0.0

    _resave(optim, negative_zero_in_padding)
    result = tailor("--verify", recipe)
    assert result.returncode == 7 and f"padding after {slot.name} (fp32) is not zero bytes" in result.stdout


@pytest.mark.parametrize("workers", ["1", "2"])
def test_a_base_whose_padding_is_not_zero_gives_zeros_there(real_run, tmp_path, workers):
    """The output's padding is zero bytes: a base's is kept where it already is (nearly always) and
    replaced by zeros, with its records' CRC-32s, where it is not (here: -0.0, 1.5 and NaN in the
    padding of a rank's three flat tensors); the output passes --verify and DeepSpeed's own load."""
    from zero_reader import read_full_state

    from tailor_tui.planning.build import build_plan
    from tailor_tui.planning.recipe_file import load_recipe

    run, spec = real_run("hf_fp32_3_tied")  # 3 ranks: padded parameters
    c2, c4, c6 = checkpoints_of(run, spec)
    base = tmp_path / "base" / c6.name
    shutil.copytree(c6, base)
    recipe = write_recipe(tmp_path, base, {"layers.1": c4})
    layout = build_plan(load_recipe(recipe), check_output=False, cache=None).base.layout
    rank = layout.world_size - 1
    padded = [s for s in layout.slots if s.valid(rank) < s.part]
    optim = next(base.glob(f"*/*rank_{rank}_*optim_states.pt"))

    def garbage_in_padding(state):
        inner = state["optimizer_state_dict"]
        flats = [inner["fp32_flat_groups"], *([g["exp_avg"] for g in inner["optimizer_state_dict"]["state"].values()],
                                              [g["exp_avg_sq"] for g in inner["optimizer_state_dict"]["state"].values()])]
        with torch.no_grad():
            for flat, value in zip(flats, (-0.0, 1.5, float("nan"))):
                for slot in padded:
                    flat[slot.group][slot.offset + slot.valid(rank): slot.offset + slot.part] = value

    _resave(optim, garbage_in_padding)
    result = tailor("--apply", recipe, "-j", workers)
    assert result.returncode == 0, result.stderr
    out = tmp_path / "composed"
    state = torch.load(next(out.glob(f"*/*rank_{rank}_*optim_states.pt")), weights_only=False)["optimizer_state_dict"]
    flats = [state["fp32_flat_groups"], *([g["exp_avg"] for g in state["optimizer_state_dict"]["state"].values()],
                                          [g["exp_avg_sq"] for g in state["optimizer_state_dict"]["state"].values()])]
    for flat in flats:
        for slot in padded:
            assert flat[slot.group][slot.offset + slot.valid(rank): slot.offset + slot.part].view(torch.int32).eq(0).all()
    verified = tailor("--verify", recipe)
    assert verified.returncode == 0, verified.stdout + verified.stderr
    assert read_full_state(out)["fp32"].keys() == read_full_state(c6)["fp32"].keys()


def test_verify_checks_the_model_file_header(real_run, tmp_path):
    recipe, out, _ = _composed(real_run, tmp_path)
    model = out / "model.safetensors"
    data = bytearray(model.read_bytes())
    at = data.index(b'"format":"pt"')
    data[at:at + 13] = b'"format":"xx"'  # metadata only: tensors and offsets unchanged
    model.write_bytes(bytes(data))
    result = tailor("--verify", recipe)
    assert result.returncode == 7 and "its header is not the base's model.safetensors header" in result.stdout


def test_a_row_of_nans_copied_exactly_verifies(real_run, tmp_path):
    run, spec = real_run("ds_blown_up")
    c2, c4, c6 = checkpoints_of(run, spec)
    blown = torch.load(next(c6.glob("*rank_0_*optim_states.pt")), weights_only=False)
    assert torch.isnan(blown["optimizer_state_dict"]["fp32_flat_groups"][0]).any()  # it really blew up
    recipe = write_recipe(tmp_path, c2, {"layers.2": c6, "layers.3": c4})
    assert tailor("--apply", recipe, "--allow-nonfinite").returncode == 0
    result = tailor("--verify", recipe)
    assert result.returncode == 0, result.stdout + result.stderr


# --- a partial save's rows file: safetensors has no CRC, save_rows records one per slice -----


def _flip_in_rows_file(rows: Path, name: str) -> None:
    from tailor_tui.formats.safetensors_in import safetensors_tensors

    begin = safetensors_tensors(rows)[name][2]  # the slice's first element: real data on every rank
    with open(rows, "r+b") as f:
        f.seek(begin + 1)
        byte = f.read(1)[0]
        f.seek(begin + 1)
        f.write(bytes([byte ^ 0x10]))


def test_a_flipped_bit_in_a_partial_save_is_refused_wherever_it_is_read(real_run, tmp_path):
    import json

    from helpers import param_row
    from safetensors import safe_open
    from safetensors.torch import load_file, save_file

    from tailor_tui.checkpoints.scan import scan
    from tailor_tui.kinds.partial import read_rows_file

    run, _spec = real_run("ds_selective_parity")
    copy = tmp_path / "sel"
    shutil.copytree(run / "run", copy)
    full, p4, p6 = scan(copy).checkpoints
    rows_file = p4.path / "global_step4" / "tailor_rows_rank_0.safetensors"
    crcs = read_rows_file(rows_file)[1]
    with safe_open(str(rows_file), "pt") as f:
        assert set(crcs) == set(f.keys())  # every slice saved has its CRC-32
    row = next(r for r in p4.saved.rows if not p6.holds(r))
    name = next(n for n in sorted(crcs) if n.startswith("fp32/") and param_row(n[5:]) == row)
    good = rows_file.read_bytes()
    on_full_base = write_recipe(tmp_path, full.path, {r: p4.path for r in p4.saved.rows}, output="a")
    on_partial_base = write_recipe(tmp_path, p6.path, {r: p4.path if p4.holds(r) else full.path
                                                       for r in full.row_names() if not p6.holds(r)}, output="b")
    made = [(on_full_base, "made", ()), (on_partial_base, "made-resharded", ("--world-size", "2"))]
    for recipe, out, extra in made:  # composed while the partial save was whole
        assert tailor("--apply", recipe, "-o", tmp_path / out, *extra).returncode == 0
    _flip_in_rows_file(rows_file, name)
    for recipe, out, extra in made:  # --verify reads the damaged save: it says so, it does not compare
        changed = tailor("--verify", recipe, "-o", tmp_path / out, *extra)  # (a write: a new ctime)
        assert changed.returncode == 7 and f"{rows_file}: changed since the composition" in changed.stdout
        as_if_rotted_in_place(tmp_path / out, rows_file)  # as bit rot would leave it: the same identity
        rotted = tailor("--verify", recipe, "-o", tmp_path / out, *extra)  # the rows it gave: proven by the record
        said = [line for line in rotted.stdout.splitlines() if line.startswith("CHANGED")]
        assert rotted.returncode == 7 and len(said) == 1, rotted.stdout + rotted.stderr
        assert rows_file.name in said[0] and name in said[0] and "fails its CRC-32 check" in said[0], said
        assert "hold what the composition took" in rotted.stderr and "FAIL" not in rotted.stdout, rotted.stdout
    for _recipe, out, _extra in made:
        shutil.rmtree(tmp_path / out)
    for recipe in (on_full_base, on_partial_base):
        assert_one_line_error(tailor("--apply", recipe), 4, rows_file.name, name, "fails its CRC-32 check")
        for world_size in ("2", "1"):  # resharding checks what it copies from a partial save too
            assert_one_line_error(tailor("--apply", recipe, "--world-size", world_size), 4, rows_file.name, name,
                                  "fails its CRC-32 check")
    assert_one_line_error(tailor("--export", on_full_base, "--to", tmp_path / "hf"), 4, rows_file.name, name,
                          "fails its CRC-32 check")
    assert not any((tmp_path / out).exists() for out in ("a", "b", "hf"))
    stats = tailor("--stats", copy, "--json")
    assert stats.returncode == 0, stats.stderr
    bad = [(c["row"], c["checkpoint"]) for c in json.loads(stats.stdout)["cells"] if not c["crc_ok"]]
    assert bad == [(row, str(p4.path))]

    # a save made before the CRCs were recorded is read as before, unchecked
    rows_file.write_bytes(good)
    for rows in p4.path.glob("global_step4/tailor_rows_rank_*.safetensors"):
        with safe_open(str(rows), "pt") as f:
            metadata = {k: v for k, v in f.metadata().items() if k != "crc32"}
        save_file(load_file(rows), rows, metadata=metadata)
        assert read_rows_file(rows)[1] == {}
    done = tailor("--apply", on_full_base)
    assert done.returncode == 0, done.stderr


def test_verify_reads_the_latest_file_it_vouches_for(real_run, tmp_path):
    """`latest` is written by the composition (DeepSpeed layout): --verify reads it too. Pointing
    it at another (complete) tag folder in the output would make DeepSpeed load that one."""
    recipe, out, _ = _composed(real_run, tmp_path, "ds_bf16_3_subgroups")
    assert tailor("--verify", recipe).returncode == 0
    shutil.copytree(out / "global_step4", out / "global_step2")
    (out / "latest").write_text("global_step2")
    result = tailor("--verify", recipe)
    assert result.returncode == 7, result.stderr
    assert f"{out / 'latest'}: names 'global_step2', not the tag 'global_step4' composed" in result.stdout
