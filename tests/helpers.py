"""Helpers the test modules share: the real CLI in a subprocess, recipes, comparisons of
composed checkpoints with their sources (through DeepSpeed's own zero_to_fp32 code), and
compositions started and signalled as a batch job would see them."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import zipfile
from dataclasses import dataclass, field
from pathlib import Path

import torch
from faults import inject
from zero_reader import optim_states, read_full_state

from tailor_tui.checkpoints.scan import scan
from tailor_tui.compose.compose_run import run_compose
from tailor_tui.formats.ptfile import read_structure
from tailor_tui.formats.ptpickle import dumps, storage_bytes
from tailor_tui.formats.ptwrite import Copied, write_archive
from tailor_tui.planning.build import build_plan
from tailor_tui.planning.recipe import Recipe
from tailor_tui.planning.recipe_draft import RecipeDraft

TAILOR = str(Path(sys.executable).with_name("tailor-tui"))




@dataclass(frozen=True)
class ComposedCase:
    """A real composition that a module's tests examine (its fixture makes it once), by name."""

    spec: object  # the run's RunSpec
    ckpts: list[Path]  # the run's checkpoints, oldest first
    out: Path  # the composed checkpoint
    run: Path | None = None  # the run folder
    picks: dict = field(default_factory=dict)  # row -> the checkpoint it was picked from
    recipe: Path | None = None  # the recipe --apply read
    events: list = field(default_factory=list)  # an in-process composition's events
    applied: subprocess.CompletedProcess | None = None  # the --apply process, its output
    name: str = ""  # what the fixture's parameter names (an architecture)

def tailor(*args, cwd=None, timeout=300, env: dict | None = None):
    env = dict(os.environ, PYTHONWARNINGS="ignore", **(env or {}))
    return subprocess.run([TAILOR, *map(str, args)], capture_output=True, text=True,
                          cwd=cwd, timeout=timeout, env=env, stdin=subprocess.DEVNULL)


# Runs a command and writes its peak resident memory (wait4's, in KiB) to a file. It is its own
# small process: a command forked straight from the test process would count the test process's
# memory too (Linux keeps the pre-exec high-water mark).
_MEASURE = ("import os, subprocess, sys\n"
            "p = subprocess.Popen(sys.argv[2:])\n"
            "_pid, status, usage = os.wait4(p.pid, 0)\n"
            "open(sys.argv[1], 'w').write(str(usage.ru_maxrss))\n"
            "sys.exit(os.waitstatus_to_exitcode(status))\n")


def tailor_peak(*args, env: dict | None = None, timeout=300) -> tuple[subprocess.CompletedProcess, int]:
    """`tailor`, and the command's own peak resident memory (bytes). Past `timeout` the command is
    killed with its measuring process (a session of their own) and TimeoutExpired raised."""
    import tempfile

    with tempfile.TemporaryDirectory() as folder:
        peak = Path(folder) / "peak"
        with subprocess.Popen([sys.executable, "-c", _MEASURE, str(peak), TAILOR, *map(str, args)],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, stdin=subprocess.DEVNULL,
                              env=dict(os.environ, PYTHONWARNINGS="ignore", **(env or {})),
                              start_new_session=True) as measuring:
            try:
                out, err = measuring.communicate(timeout=timeout)
            except subprocess.TimeoutExpired:
                os.killpg(measuring.pid, signal.SIGKILL)  # the command too, not only what measures it
                measuring.communicate()
                raise
        result = subprocess.CompletedProcess(measuring.args, measuring.returncode, out, err)
        return result, int(peak.read_text()) * 1024


def write_recipe(folder: Path, base: Path, layers: dict, output: str | None = "composed") -> Path:
    """A recipe whose paths are relative to its own folder, as users write them."""
    rel = lambda p: os.path.relpath(p, folder)  # noqa: E731
    lines = ["version: 1", f"base: {rel(base)}"]
    if output:
        lines.append(f"output: {output}")
    lines.append("layers:")
    lines += [f"  {row}: {rel(src)}" for row, src in layers.items()]
    path = folder / "recipe.yaml"
    path.write_text("\n".join(lines) + "\n")
    return path


def stats_json(run) -> dict:
    """`--stats RUN --json` through the real CLI: the run's checkpoints and a cell per row and checkpoint."""
    import json

    result = tailor("--stats", run, "--json", "-j", "2")
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout)


def row_at(ckpt: Path, module: str):
    """The row (tailor_tui's `Row`) of checkpoint `ckpt` whose module is `module` (a plain model's
    module path, such as `model.vision_tower.encoder.layers.1`, that of a PEFT model's too): what a
    recipe names it, whatever rows are called."""
    from tailor_tui.checkpoints.checkpoint import open_checkpoint
    from tailor_tui.checkpoints.rows import PEFT_PREFIX

    rows = [r for r in open_checkpoint(ckpt).rows if r.module_path in (module, PEFT_PREFIX + module)]
    assert len(rows) == 1, (module, [r.module_path for r in open_checkpoint(ckpt).rows])
    return rows[0]


def weight_files(folder: Path) -> list[str]:
    """The model's (or adapter's) weight files in a checkpoint folder: safetensors and pytorch_model*.bin."""
    return sorted(p.name for p in folder.iterdir() if p.suffix == ".safetensors"
                  or (p.name.startswith("pytorch_model") and p.suffix == ".bin"))


def tensors(path: Path) -> dict[str, torch.Tensor]:
    """Every tensor of a weight file, read by its own library (safetensors, torch.load)."""
    if path.suffix == ".safetensors":
        from safetensors import safe_open

        with safe_open(path, "pt") as f:
            return {k: f.get_tensor(k) for k in f.keys()}
    return torch.load(path, weights_only=True)


def apply_and_verify(recipe: Path, *extra: str) -> None:
    """`--apply` the recipe (with `extra` options), then `--verify` it: both succeed."""
    applied = tailor("--apply", recipe, *extra)
    assert applied.returncode == 0, applied.stderr
    verified = tailor("--verify", recipe)
    assert verified.returncode == 0, verified.stdout + verified.stderr


def on_xfs(real_run, xfs: Path, name: str) -> tuple[Path, object, list[Path]]:
    """The cached real run `name`, copied onto the loop XFS (the `xfs` fixture) byte by byte: sharing
    nothing; its spec and its checkpoints, oldest first."""
    import shutil

    from conftest import checkpoints_of

    run, spec = real_run(name)
    there = xfs / name
    if not there.exists():
        shutil.copytree(run, there)
    return there, spec, checkpoints_of(there, spec)


def output_files(folder: Path) -> dict[str, object]:
    """Every file of an output but its provenance record: its bytes, or a torch-format weight file's
    tensors (a clone keeps the base's archive, whose pickle and id torch's writer would write anew)."""
    def tensor_bytes(path: Path) -> dict[str, bytes]:
        return {name: t.contiguous().view(-1).view(torch.uint8).numpy().tobytes()
                for name, t in torch.load(path, weights_only=True).items()}

    return {str(f.relative_to(folder)): tensor_bytes(f) if f.suffix == ".bin" and f.name != "training_args.bin"
            else f.read_bytes() for f in sorted(folder.rglob("*")) if f.is_file() and f.name != "tailor_provenance.json"}


def assert_one_line_error(result, code: int, *needles: str):
    assert result.returncode == code, result.stderr
    assert "Traceback" not in result.stderr and "internal error" not in result.stderr, result.stderr
    errors = [line for line in result.stderr.splitlines() if line.startswith("error: ")]
    assert len(errors) == 1, result.stderr
    for needle in needles:
        assert needle in errors[0], errors[0]


def start_apply(recipe: Path, *extra: str, env: dict | None = None) -> subprocess.Popen:
    """A composition slowed to several seconds (test checkpoints are tiny), so signals land mid-composition."""
    return start_tailor("--apply", recipe, *extra, env=env)


def _signals_at_default() -> None:
    """SIGINT and SIGHUP at their defaults in a started tailor-tui, whatever this process inherited (a shell's
    background job ignores SIGINT, `nohup` SIGHUP: ignored signals stay ignored across exec, and its workers
    would then shrug off the hangup a test sends them)."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)
    signal.signal(signal.SIGHUP, signal.SIG_DFL)


def start_tailor(*args, env: dict | None = None) -> subprocess.Popen:
    """tailor-tui started with its work slowed to several seconds (test checkpoints are tiny), so
    signals land mid-work: each progress step sleeps 0.4 s (faults/inject.py; `env` may ask for
    another pace, `inject.environment(slow=...)`, or for more faults). SIGINT and SIGHUP start at their
    defaults whatever this process inherited (`_signals_at_default`), as in a terminal."""
    return subprocess.Popen([TAILOR, *map(str, args)], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True,
                            preexec_fn=_signals_at_default,
                            env={**os.environ, "PYTHONWARNINGS": "ignore", **inject.environment(slow=0.4),
                                 **(env or {})})


def wait_for_line(proc: subprocess.Popen, start: str) -> str:
    """Read the composition's log up to the first line that starts with `start`; returns what was read.
    "composing": planned, workers about to start; "rank ": a worker is composing."""
    seen = ""
    while line := proc.stderr.readline():
        seen += line
        if line.startswith(start):
            return seen
    raise AssertionError(f"the composition ended before a line starting {start!r}:\n{seen}")


def finish(proc: subprocess.Popen, seen: str) -> str:
    """Everything the process wrote to stderr, once it has exited."""
    err = seen + proc.stderr.read()
    proc.wait(timeout=60)
    return err


def hidden(folder: Path) -> list[Path]:
    return [p for p in folder.iterdir() if p.name.startswith(".")]


def param_row(name: str) -> str:
    """Row of a parameter name, by the documented rule (independent of tailor_tui.checkpoints.rows)."""
    parts = name.split(".")
    if parts[0] == "model":
        parts = parts[1:]
    return ".".join(parts[:2]) if parts[0] == "layers" else parts[0]


def parity_picks(spec, ckpts: list[Path]) -> dict[str, Path]:
    """Odd layers from the middle checkpoint, embeddings from the oldest, the rest the base's."""
    oldest, middle, _base = ckpts
    picks = {f"layers.{i}": middle for i in range(1, spec.layers, 2)}
    picks["embed_tokens"] = oldest
    picks["norm"] = middle
    if not spec.tied:
        picks["lm_head"] = oldest
    return picks


def compose(tmp_path: Path, ckpts: list[Path], picks: dict[str, Path], workers: int = 1):
    recipe = Recipe(base=ckpts[-1], output=tmp_path / "composed", layers=picks)
    plan = build_plan(recipe)
    events = []
    run_compose(plan, workers=workers, emit=events.append)
    return plan.output, events


def two_checkpoint_picks(spec, oldest) -> dict:
    """Odd layers (one with a frozen parameter), embeddings and lm_head from the oldest checkpoint."""
    picks = {f"layers.{i}": oldest for i in range(1, spec.layers, 2)}
    picks["embed_tokens"] = oldest
    if not spec.tied:
        picks["lm_head"] = oldest
    return picks


def assert_rows_from_picks(out, picks: dict, base, tied: bool = False) -> None:
    """Every parameter's fp32 weights and every optimizer state kept per element (exp_avg and exp_avg_sq of
    Adam's, whatever the optimizer keeps) in `out` are its chosen source's (read by DeepSpeed's zero_to_fp32
    code; frozen parameters are among the fp32 weights; a tied lm_head, which zero_to_fp32 lists as a copy of
    the embeddings, follows embed_tokens)."""
    got = read_full_state(out)
    want = {c: read_full_state(c) for c in {base, *picks.values()}}
    assert got.keys() == want[base].keys()
    for key in got:
        assert got[key].keys() == want[base][key].keys()
        for param, value in got[key].items():
            row = "embed_tokens" if tied and param_row(param) == "lm_head" else param_row(param)
            assert torch.equal(value, want[picks.get(row, base)][key][param]), (key, param)


def assert_optim_states_equal(out, resaved) -> None:
    """Every rank's fp32 weights and every optimizer state (moments, steps, whatever the optimizer keeps) in
    `resaved` equal `out`'s, bit for bit."""
    for mine, theirs in zip(optim_states(out), optim_states(resaved), strict=True):
        for a, b in zip(mine["fp32_flat_groups"], theirs["fp32_flat_groups"], strict=True):
            assert torch.equal(a, b)
        assert mine["optimizer_state_dict"]["state"].keys() == theirs["optimizer_state_dict"]["state"].keys()
        for g, st in mine["optimizer_state_dict"]["state"].items():
            again = theirs["optimizer_state_dict"]["state"][g]
            assert st.keys() == again.keys(), (g, sorted(st), sorted(again))
            for key in st:
                assert torch.equal(torch.as_tensor(st[key]), torch.as_tensor(again[key])), (g, key)


def expect_rows_from(out, sources: dict[str, object]) -> None:
    """Every parameter's fp32 / exp_avg / exp_avg_sq in `out` equals the reference checkpoint
    its row was taken from (`sources`: row -> reference tag folder)."""
    mine = read_full_state(out)
    refs = {ref: read_full_state(ref) for ref in dict.fromkeys(sources.values())}
    for ref, theirs in refs.items():  # the same states of the same parameters: none missing, none added
        assert {key: set(tensors) for key, tensors in mine.items()} == \
            {key: set(tensors) for key, tensors in theirs.items()}, (out, ref)
    for key, tensors in mine.items():
        for name, value in tensors.items():
            ref = sources[param_row(name)]
            assert torch.equal(value, refs[ref][key][name]), (key, name, ref)


def compose_newest_per_row(runs, tmp_path):
    """Compose a full, a step-4 and a step-6 partial checkpoint with the composer's default picks
    (each row from the newest checkpoint that saved it) through the real CLI, and --verify it.
    Returns the three checkpoints and the output folder."""
    comp = RecipeDraft.start(list(scan(runs).checkpoints))
    full, p4, p6 = comp.checkpoints
    assert comp.base == 2 and comp.missing_rows() == []  # the default: newest checkpoint per row
    assert {row: col for row, col in comp.picks.items()} == {r: 1 for r in p4.saved.rows}
    recipe = comp.to_recipe()
    path = write_recipe(tmp_path, recipe.base, recipe.layers, output="composed")

    result = tailor("--apply", path)
    assert result.returncode == 0, result.stderr
    verified = tailor("--verify", path)
    assert verified.returncode == 0, verified.stdout + verified.stderr
    out = tmp_path / "composed"
    for f in (out / p6.tag).glob("*optim_states.pt"):  # built from the skeleton: CRCs right
        with zipfile.ZipFile(f) as z:
            assert z.testzip() is None, f
    return (full, p4, p6), out


def edit_structure(path: Path, change) -> None:
    """Change what a real zip-format `.pt` file holds, as a crafted or damaged file would, and
    write it back whole and consistent (CRCs right), as torch.save would have written the
    changed object. `change(obj)` edits the torch-free reader's stand-ins in place and returns
    the bytes of storages it made anew ({id(StorageRef): bytes}) or None."""
    obj, records, prefix = read_structure(path)
    made = change(obj) or {}
    data, storages = dumps(obj, location=None)
    fills = []
    for s in storages:
        if id(s) in made:
            fills.append(made[id(s)])
        else:
            record = records[f"{prefix}data/{s.key}"]
            fills.append(Copied(path, record, record.data_offset, storage_bytes(s)))
    edited = path.with_name(path.name + ".edited")
    write_archive(edited, archive=prefix.rstrip("/"), pickle=data, storages=fills)
    os.replace(edited, path)


def flip_byte(path: Path, record_suffix: str, where: float = 0.5) -> str:
    """Flip one bit inside a record of a zip-format torch file, as bit rot would; returns its name."""
    with zipfile.ZipFile(path) as z:
        info = next(i for i in z.infolist() if i.filename.endswith(record_suffix))
    with open(path, "r+b") as f:
        f.seek(info.header_offset + 26)
        name_len, extra_len = (int.from_bytes(f.read(2), "little") for _ in range(2))
        at = info.header_offset + 30 + name_len + extra_len + int(info.file_size * where)
        f.seek(at)
        byte = f.read(1)[0]
        f.seek(at)
        f.write(bytes([byte ^ 0x10]))
    return info.filename


def flat_record(path: Path) -> str:
    """The record of the largest storage (a flat fp32 / exp_avg / exp_avg_sq group)."""
    with zipfile.ZipFile(path) as z:
        return max((i for i in z.infolist() if "/data/" in i.filename), key=lambda i: i.file_size).filename


def fsynced_files(monkeypatch) -> set:
    """The files (device, inode) fsynced from now on in this process (os.fsync recorded)."""
    found: set = set()
    real = os.fsync

    def record(fd: int) -> None:
        st = os.fstat(fd)
        found.add((st.st_dev, st.st_ino))
        real(fd)

    monkeypatch.setattr(os, "fsync", record)
    return found


def assert_every_file_fsynced(out: Path, fsynced: set) -> None:
    """Every file and folder of a published output was fsynced before it counted as written."""
    for f in [out, *out.rglob("*")]:
        st = f.stat()
        assert (st.st_dev, st.st_ino) in fsynced, f"{f} was never fsynced"



# Worker tasks for `workers.run_calls`, each given a job-like namespace (task, total_bytes): one per batch.
def task_until_cancelled(job, emit, cancelled, options) -> str:
    """Counts until the composition is cancelled."""
    from tailor_tui.events import ByteCounter

    counter = ByteCounter(job.task, 1 << 40, emit, cancelled, options=options, interval=0.0)
    while True:
        counter.add(1 << 20)
        time.sleep(0.002)


def task_asking_to_stop(job, emit, cancelled, options) -> str:
    """Asks whether to stop, from four threads at once, again and again, for up to 60 s: whatever the stop
    flag takes to be asked, one of them nearly always holds it."""
    import threading

    Path(job.asking).touch()  # (a namespace's: the test's folder) asking from now on
    end = time.monotonic() + 60

    def ask() -> None:
        while not cancelled() and time.monotonic() < end:
            pass

    askers = [threading.Thread(target=ask) for _ in range(4)]
    for thread in askers:
        thread.start()
    for thread in askers:
        thread.join()
    return job.task


def task_with_common(common, job, emit, cancelled, options) -> tuple[str, str, int]:
    """What every call shares (`run_calls`' `common`), the call's own task, and the process it ran in."""
    return common, job.task, os.getpid()


def task_failing_soon(job, emit, cancelled, options) -> str:
    time.sleep(0.5)
    raise OSError(f"{job.task} failed")


def task_flooding_events(job, emit, cancelled, options) -> str:
    """Sends far more events than a pipe holds, looking at no cancel flag, then ends."""
    from tailor_tui.events import TaskProgressed

    for i in range(50_000):
        emit(TaskProgressed(job.task, i, 50_000))
        if i % 1000 == 0:
            time.sleep(0.01)  # one message per 1000 events would not fill the pipe: let the outbox send often
    return job.task


def free_port() -> int:
    """A TCP port nobody listens on now (for a job's MASTER_PORT)."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def slurm_tasks(args, n=2, env=None, job="777") -> list[subprocess.Popen]:
    """`n` tailor-tui processes started as srun starts the tasks of one job step (on this one machine)."""
    port = str(free_port())
    return [subprocess.Popen([TAILOR, *map(str, args)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                             stdin=subprocess.DEVNULL,
                             env={**os.environ, "PYTHONWARNINGS": "ignore", "SLURM_PROCID": str(p),
                                  "SLURM_NTASKS": str(n), "SLURM_JOB_ID": job, "SLURM_STEP_ID": "0",
                                  "SLURM_STEP_NODELIST": "localhost", "MASTER_PORT": port, **(env or {})})
            for p in range(n)]


def as_if_rotted_in_place(output: Path, changed: Path) -> None:
    """Make `output`'s provenance record hold `changed`'s identity as it is now: as bit rot, which changes
    no file's size, mtime or ctime, would have left it (a test's flip of a byte is a write, which does):
    `--verify` then reads the source as a rotten file it cannot tell changed, not as one saved again."""
    import json

    record_file = output / "tailor_provenance.json"
    record = json.loads(record_file.read_text())
    st, found = changed.stat(), 0
    for entry in [record["base"], *record["sources"]]:
        for rel, was in entry["files"].items():
            if (Path(entry["path"]) / rel).resolve() == changed.resolve():
                was.update(bytes=st.st_size, mtime=st.st_mtime, mtime_ns=st.st_mtime_ns, ctime_ns=st.st_ctime_ns,
                           inode=st.st_ino)
                found += 1
    assert found, f"{changed} is not in {record_file}"
    record_file.write_text(json.dumps(record))
