"""The verifier shares no code with the writers: a bug in a writer is caught, not repeated.

Each test breaks one of the writers' own ways of finding a source's bytes (in this process, with
the headless API: `run_compose(..., workers=1)` runs every job here), so that it writes
wrong-but-plausible bytes (one bit of one element, one element off), and shows that
`verify_against_recipe` reports the rows affected and nothing else; the same composition
unbroken verifies clean. The import-linter contract (tests/test_structure.py) keeps the
verifier from importing the writers; these show that it also does not need them.
"""

from __future__ import annotations

import pytest
from conftest import checkpoints_of
from helpers import write_recipe

from tailor_tui.checkpoints.scan import scan
from tailor_tui.compose import model_files
from tailor_tui.compose.compose_run import run_compose
from tailor_tui.planning.build import build_plan
from tailor_tui.planning.plan import ComposePlan
from tailor_tui.planning.recipe import Recipe
from tailor_tui.planning.recipe_file import load_recipe
from tailor_tui.resharding import partition
from tailor_tui.verifying.against_recipe import verify_against_recipe


def _rows(report) -> dict[str, list[str]]:
    assert not report.other, report.other
    return {row: found for row, found in report.problems.items() if found}


@pytest.fixture(scope="module")
def selective_hf(real_run):
    """The HF selective run: a full checkpoint-2 as the base, every row partial-step4 saved taken from
    it, so that the 16-bit model file's tensors of those rows are cast from the partial's fp32 masters
    (and its frozen parameter, in layers.2, taken from the partial's model_states)."""
    run, _spec = real_run("hf_selective_parity")
    runs = run / "run"
    p4 = scan(runs).checkpoints[1]
    assert "layers.2" in p4.saved.rows  # the row of the run's frozen parameter
    return runs, p4


def _compose_from_partial(selective_hf, out):
    runs, p4 = selective_hf
    recipe = Recipe(base=runs / "checkpoint-2", output=out,
                    layers={row: runs / "partial-step4" for row in p4.saved.rows})
    run_compose(build_plan(recipe), workers=1)
    return verify_against_recipe(build_plan(recipe, check_output=False))


def test_a_model_file_cast_from_a_partial_checkpoint_verifies_clean(selective_hf, tmp_path):
    report = _compose_from_partial(selective_hf, tmp_path / "out")
    assert report.ok, (report.other, dict(report.problems))


def _one_bit_off(data: bytes) -> bytes:
    """The same bytes but the lowest bit of the first byte: a value one unit in the last place away."""
    return bytes([data[0] ^ 1]) + bytes(data[1:])


def test_a_wrong_tensor_from_the_writers_lookup_of_a_partials_bytes_is_reported(selective_hf, tmp_path, monkeypatch):
    """`model_files.source_tensor` (the writer's lookup of a partial checkpoint's frozen parameters and
    buffers, once also what --verify compared against) returns bytes one bit off: the verifier, which
    reads the partial's model_states itself, reports each tensor it was used for, under its row."""
    real, used = model_files.source_tensor, []

    def wrong(job, s, name, dtype, shape):
        used.append((name, job.rows[name]))
        return _one_bit_off(real(job, s, name, dtype, shape))

    monkeypatch.setattr(model_files, "source_tensor", wrong)
    report = _compose_from_partial(selective_hf, tmp_path / "out")
    assert ("model.layers.2.mlp.down_proj.weight", "layers.2") in used  # the frozen parameter
    expected: dict[str, list[str]] = {}
    for name, row in used:
        expected.setdefault(row, []).append(f"model.safetensors: {name} (row {row}) differs from partial-step4's")
    assert _rows(report) == expected


def test_a_wrong_cast_of_a_partials_masters_is_reported(selective_hf, tmp_path, monkeypatch):
    """The writer's cast of a partial's fp32 master slices to the model file's dtype is one bit off
    (the first element of each slice): every trainable tensor of every row taken from the partial is
    reported, and no other row."""
    runs, p4 = selective_hf
    real = model_files._cast
    monkeypatch.setattr(model_files, "_cast", lambda view, stored, dtype: _one_bit_off(real(view, stored, dtype)))
    report = _compose_from_partial(selective_hf, tmp_path / "out")
    found = _rows(report)
    assert set(found) == set(p4.saved.rows), found
    assert all(p.startswith("model.safetensors: model.") and p.endswith("differs from partial-step4's")
               for problems in found.values() for p in problems)


def test_a_slice_copied_one_element_off_is_reported(real_run, tmp_path, monkeypatch):
    """The plan's first slice taken from another checkpoint tells the rank writers an offset one
    element on: the rank files hold the base's element where the slice starts and the source's past
    its end. The verifier, which locates every parameter by the layout, reports that row."""
    run, spec = real_run("hf_bf16_2")
    c2, _c4, c6 = checkpoints_of(run, spec)
    real = ComposePlan._slices
    shifted = []

    def one_off(self, rank, src, owner):
        row_slots, copies, padding = real(self, rank, src, owner)
        sizes = self.base.layout.group_sizes()
        for i, c in enumerate(copies):
            if c.source and c.offset + c.length + 1 <= sizes[c.group]:
                shifted.append((rank, next(s.row for s in row_slots if s.group == c.group and s.offset == c.offset)))
                copies = (*copies[:i], type(c)(c.group, c.offset + 1, c.length, c.source, c.param), *copies[i + 1:])
                break
        return row_slots, copies, padding

    monkeypatch.setattr(ComposePlan, "_slices", one_off)
    recipe = Recipe(base=c6, output=tmp_path / "out", layers={"layers.1": c2})
    run_compose(build_plan(recipe), workers=1)
    report = verify_against_recipe(build_plan(recipe, check_output=False))
    assert shifted
    found = _rows(report)
    for rank, row in shifted:
        assert any(p.startswith(f"rank {rank}: ") and "differs from checkpoint-2" in p
                   for p in found.get(row, ())), found
    monkeypatch.undo()
    run_compose(build_plan(Recipe(base=c6, output=tmp_path / "clean", layers={"layers.1": c2})), workers=1)
    assert verify_against_recipe(build_plan(Recipe(base=c6, output=tmp_path / "clean", layers={"layers.1": c2}),
                                            check_output=False)).ok


def test_a_resharded_piece_read_one_element_off_is_reported(real_run, tmp_path, monkeypatch):
    """Resharding: one parameter's pieces, as the plan's jobs give them to the writers, start one
    element on in their source rank. The verifier works out each output rank's pieces itself (it
    once took them from those same jobs, and would have agreed): it reports that parameter's row."""
    run, spec = real_run("ds_bf16_3_subgroups")
    c2, _c4, c6 = checkpoints_of(run, spec)
    recipe_path = write_recipe(tmp_path, c6, {"layers.2": c2})
    recipe_path.write_text(recipe_path.read_text().replace("layers:\n", "world_size: 2\nlayers:\n"))
    recipe = load_recipe(recipe_path)
    target = "model.layers.2.self_attn.q_proj.weight"
    real = partition._Parameter.pieces

    def one_off(self, rank):
        found = list(real(self, rank))
        if self.name == target:
            for i, p in enumerate(found):
                if p.source != partition.ZEROS and p.within + p.length < p.whole:
                    found[i] = p._replace(offset=p.offset + 1, within=p.within + 1)
                    break
        return found

    monkeypatch.setattr(partition._Parameter, "pieces", one_off)
    plan = build_plan(recipe)
    run_compose(plan, workers=1)
    report = verify_against_recipe(build_plan(recipe, check_output=False))
    found = _rows(report)
    assert list(found) == ["layers.2"], found
    assert all(f" of {target} (elements " in p and f"differs from {c2.name} rank" in p
               for p in found["layers.2"]), found
    monkeypatch.undo()
    clean = build_plan(load_recipe(recipe_path), output=tmp_path / "clean")
    run_compose(clean, workers=1)
    assert verify_against_recipe(build_plan(load_recipe(recipe_path), output=tmp_path / "clean",
                                            check_output=False)).ok


def test_a_partials_tensors_are_claimed_as_they_are_read_not_loaded(selective_hf, tmp_path, monkeypatch):
    """Every tensor of the model file taken from the partial is claimed on what the partial keeps of it and
    compared as it is read (`streamed`: memory bounded whatever the tensor's size): each trainable one on its
    ranks' fp32 master slices, cast to the file's 16 bits; its frozen parameter on each rank's fragment in
    model_states. None is loaded by torch."""
    from tailor_tui.verifying import streamed, weights

    runs, p4 = selective_hf
    loaded, cast = [], []
    real_compare, real_claim = weights._compare_cast, streamed.Comparison.claim

    def compare(ranks, job, out_file, name, s, sources):
        loaded.append(job.params.get(name, name))
        return real_compare(ranks, job, out_file, name, s, sources)

    def claim(self, *args, **kwargs):
        cast.append(kwargs.get("cast", ""))
        return real_claim(self, *args, **kwargs)

    monkeypatch.setattr(weights, "_compare_cast", compare)
    monkeypatch.setattr(streamed.Comparison, "claim", claim)
    report = _compose_from_partial(selective_hf, tmp_path / "out")
    assert report.ok, (report.other, dict(report.problems))
    assert loaded == [], loaded
    trainable = {slot.name for slot in p4.layout.slots}
    assert cast.count("BF16") >= len(trainable), cast.count("BF16")  # (a slice per rank of each)
