"""Benchmark: selective (partial) saves against `engine.save_checkpoint`, in one run.

Trains the medium model of bench_merge.py (Llama-like, 12 layers, hidden 1024, MLP 2816,
vocab 32000, bf16) for one step with real DeepSpeed ZeRO-3 on 4 CPU ranks, then saves in
turn, several times: a full `engine.save_checkpoint`, a parity save (every other row,
`tailor_tui.selective.saver.save_rows`) and a filter save (first and last layer, embeddings,
norm, lm_head). Each save is timed on rank 0 from the barrier before it to the barrier
after it plus a `sync` (tailor-tui's saves fsync; DeepSpeed's do not, so both are timed
until the bytes are on disk). Prints sizes, the fraction of parameters saved, and the
size and time ratios against the full save (medians). Then recovery: composing a full
checkpoint from two parity partials (`tailor-tui --apply`, a partial base) against `cp -r`
of a full checkpoint, with the workers' peak RSS.

    python bench/bench_selective.py [--repeats 3] [--dir .tailor-cache/bench/selective]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))  # the tests' real runs (tests/runs.py)

import run_models  # noqa: E402
from runs import RunSpec  # noqa: E402

from tailor_tui.demo import ranks  # noqa: E402

SPEC = RunSpec(world_size=4, dtype="bf16", layout="deepspeed", layers=12, hidden=1024,
               intermediate=2816, vocab=32000, steps=1, save_every=1)


def size_of(folder: Path) -> int:
    return sum(f.stat().st_size for f in folder.rglob("*") if f.is_file())


def _bench_rank(rank, world, port, spec, out: str, repeats: int) -> None:
    ranks.quiet()
    ranks.setup_rank(rank, world, port)
    import deepspeed
    import torch
    import torch.distributed as dist

    from tailor_tui.selective.saver import Filter, Parity, model_rows, row_naming, save_rows

    out = Path(out)
    model = run_models.build_model(spec)
    opt = torch.optim.AdamW(run_models.param_groups(model), lr=1e-3)
    engine, *_ = deepspeed.initialize(model=model, optimizer=opt, config=spec.ds_config(for_trainer=False))
    ids = run_models.training_batches(spec, 1, rank)[0]
    engine.backward(engine(input_ids=ids, labels=ids).loss)
    engine.step()

    rows = model_rows(engine)
    numel, naming = {}, row_naming(engine)
    for name, p in engine.module.named_parameters():
        numel[naming.row_of(name)] = numel.get(naming.row_of(name), 0) + p.ds_numel
    kinds = {
        "full save_checkpoint": None,
        "parity save_rows": Parity().rows_for(1, rows),
        "filter save_rows": Filter(first=1, last=1).rows_for(1, rows),
    }
    times = {k: [] for k in kinds}
    sizes, fractions = {}, {}
    for i in range(repeats):
        for kind, chosen in kinds.items():
            folder = out / f"{kind.split()[0]}-{i}"
            dist.barrier()
            started = time.perf_counter()
            if chosen is None:
                engine.save_checkpoint(str(folder), tag="global_step1")
            else:
                save_rows(engine, folder, chosen)
            dist.barrier()
            if rank == 0:
                os.sync()
                times[kind].append(time.perf_counter() - started)
                sizes[kind] = size_of(folder)
                fractions[kind] = sum(numel[r] for r in (chosen or rows)) / sum(numel.values())
                shutil.rmtree(folder)
                os.sync()
    # for the compose bench: parity partials covering every row (odd rows, then even rows), and
    # the full checkpoint a normal run would have written, to compare against cp -r of it
    save_rows(engine, out / "compose", Parity().rows_for(1, rows), step=1)
    save_rows(engine, out / "compose", Parity().rows_for(2, rows), step=2)
    engine.save_checkpoint(str(out / "full"), tag="global_step1")
    if rank == 0:
        (out / "result.json").write_text(json.dumps({"times": times, "sizes": sizes, "fractions": fractions}))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--dir", type=Path, default=ROOT / ".tailor-cache" / "bench" / "selective")
    args = ap.parse_args()
    shutil.rmtree(args.dir, ignore_errors=True)
    args.dir.mkdir(parents=True)
    ranks.spawn_ranks(_bench_rank, SPEC, str(args.dir), args.repeats)
    result = json.loads((args.dir / "result.json").read_text())
    full = "full save_checkpoint"
    t_full = statistics.median(result["times"][full])
    s_full = result["sizes"][full]
    print(f"{SPEC.layers}-layer hidden-{SPEC.hidden} bf16 model, {SPEC.world_size} ranks on {os.cpu_count()} cores; "
          f"medians of {args.repeats} saves each, timed until synced to disk")
    print(f"{'':<22} {'size':>9} {'params':>7} {'time':>7}  {'size ratio':>10} {'time ratio':>10}  time/size")
    for kind, times in result["times"].items():
        t, s, frac = statistics.median(times), result["sizes"][kind], result["fractions"][kind]
        size_ratio, time_ratio = s_full / s, t_full / t
        print(f"{kind:<22} {s / 2**30:6.2f} GiB {frac:7.1%} {t:6.2f} s  {size_ratio:9.2f}x {time_ratio:9.2f}x"
              f"  {time_ratio / size_ratio:8.0%}")
    print("targets: saved size / full size within 10% of the fraction of parameters saved; "
          "time ratio at least 80% of the size ratio")
    compose_from_partials(args.dir, args.repeats)


def compose_from_partials(folder: Path, repeats: int) -> None:
    """Recovery: compose a full checkpoint from two parity partials (the newer one the base),
    timed against cp -r of a full checkpoint of the same model (the same bytes to write)."""
    from bench_merge import timed

    full, work = folder / "full" / "global_step1", folder / "work"
    work.mkdir()
    recipe = work / "recover.yaml"
    older = folder / "compose" / "partial-step1"
    held = json.loads((older / "tailor_partial.json").read_text())["rows"]
    recipe.write_text(f"version: 1\nbase: {folder / 'compose' / 'partial-step2'}\noutput: {work / 'out'}\n"
                      "layers:\n" + "".join(f"  {r}: {older}\n" for r in held))
    commands = {
        "cp -r (full checkpoint)": ["cp", "-r", str(full), str(work / "out")],
        "cp -r; sync": ["sh", "-c", f'cp -r "{full}" "{work / "out"}" && sync'],  # tailor-tui fsyncs
        "tailor-tui --apply": [str(Path(sys.executable).with_name("tailor-tui")), "--apply", str(recipe),
                               "--report-peak-rss"],
    }
    times, peak = {k: [] for k in commands}, 0
    for _ in range(repeats):
        for name, cmd in commands.items():
            shutil.rmtree(work / "out", ignore_errors=True)
            subprocess.run(["sync"])
            seconds, rss = timed(cmd)
            times[name].append(seconds)
            peak = max(peak, rss)
    shutil.rmtree(work / "out", ignore_errors=True)
    cp = statistics.median(times["cp -r (full checkpoint)"])
    rank_file = max(f.stat().st_size for f in full.glob("*optim_states.pt"))
    print(f"\nrecovery from two parity partials (partial base; {size_of(full) / 2**30:.2f} GiB written), "
          f"medians of {repeats}:")
    for name, t in times.items():
        print(f"{name:<24} {statistics.median(t):6.2f} s  {statistics.median(t) / cp:5.2f}x cp")
    print(f"peak worker RSS {peak / 2**30:.2f} GiB (largest rank file {rank_file / 2**30:.2f} GiB)")


if __name__ == "__main__":
    main()
