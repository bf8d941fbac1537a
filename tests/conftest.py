"""Real DeepSpeed ZeRO-3 runs, made once per test session (and cached between sessions).

Every checkpoint the tests read was written by real DeepSpeed on CPU; the HF runs by
the real HF Trainer. Set TAILOR_RUN_CACHE to choose the cache folder; the cache key
covers the run spec, the generator's (and selective saver's) source and the DeepSpeed/transformers versions,
so a stale cache is never used.
"""

from __future__ import annotations

import hashlib
import os
import shutil
from pathlib import Path

import pytest

os.environ.setdefault("DS_ACCELERATOR", "cpu")

from tailor_tui import demo_run, selective, selective_hf  # noqa: E402
from tailor_tui.demo_run import RunSpec  # noqa: E402

RUNS = {
    # HF Trainer layout, 2 ranks, bf16, separate lm_head
    "hf_bf16_2": RunSpec(),
    # HF Trainer layout, 3 ranks (sizes that do not divide), fp32, tied embeddings, a frozen param
    "hf_fp32_3_tied": RunSpec(
        world_size=3, dtype="fp32", tied=True, frozen=("model.layers.2.mlp.down_proj.weight",)
    ),
    # DeepSpeed save_dir layout, 3 ranks, bf16, sub_group_size splits groups, a frozen param
    "ds_bf16_3_subgroups": RunSpec(
        world_size=3,
        layout="deepspeed",
        sub_group_size=2000,
        frozen=("model.layers.1.mlp.up_proj.weight",),
    ),
    # Selective checkpointing (tailor_tui.selective, parity): OUT/run holds a full save at step 2
    # and partial saves at steps 4 and 6; OUT/reference full saves of the same run at 2, 4, 6
    "ds_selective_parity": RunSpec(
        world_size=3,
        layout="deepspeed",
        sub_group_size=2000,
        frozen=("model.layers.1.mlp.up_proj.weight",),
        selective="parity",
    ),
    # The same through the HF Trainer callback (tailor_tui.selective_hf): 3 ranks, bf16 (16-bit
    # weights cast from fp32 masters), tied embeddings and a frozen parameter (both in model files)
    "hf_selective_parity": RunSpec(
        world_size=3,
        tied=True,
        frozen=("model.layers.2.mlp.down_proj.weight",),
        selective="parity",
    ),
}


def _cache_root() -> Path:
    root = os.environ.get("TAILOR_RUN_CACHE")
    return Path(root) if root else Path(__file__).resolve().parent.parent / ".tailor-cache" / "runs"


def _key(spec: RunSpec) -> str:
    import deepspeed
    import transformers

    h = hashlib.sha256()
    h.update(spec.key().encode())
    h.update(Path(demo_run.__file__).read_bytes())
    for saver in (selective, selective_hf):  # partial saves are written by them
        h.update(Path(saver.__file__).read_bytes())
    h.update(f"{deepspeed.__version__} {transformers.__version__}".encode())
    return h.hexdigest()[:16]


@pytest.fixture(scope="session")
def real_run():
    """real_run(name) -> (run folder, spec); trains the run on first use."""
    made: dict[str, Path] = {}

    def get(name: str) -> tuple[Path, RunSpec]:
        spec = RUNS[name]
        if name not in made:
            folder = _cache_root() / f"{name}-{_key(spec)}"
            if not (folder / "tailor_demo_spec.json").is_file():
                shutil.rmtree(folder, ignore_errors=True)
                partial = folder.with_name(folder.name + ".partial")
                shutil.rmtree(partial, ignore_errors=True)
                demo_run.make_run(partial, spec)
                partial.rename(folder)
            made[name] = folder
        return made[name], spec

    return get


def checkpoints_of(run: Path, spec: RunSpec) -> list[Path]:
    """The run's checkpoint folders as a recipe names them, oldest first."""
    steps = range(spec.save_every, spec.steps + 1, spec.save_every)
    if spec.layout == "hf":
        return [run / f"checkpoint-{s}" for s in steps]
    return [run / f"global_step{s}" for s in steps]


def tree_digest(*roots: Path) -> dict[str, str]:
    """sha256 of every file under `roots`: proof that sources were not modified."""
    out = {}
    for root in roots:
        for f in sorted(Path(root).rglob("*")):
            if f.is_file():
                out[str(f)] = hashlib.sha256(f.read_bytes()).hexdigest()
    return out
