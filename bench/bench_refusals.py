"""Benchmark: every hostile input of tests/refusal_cases.py, refused (or skipped) within bounds.

Makes (once, cached) a real ZeRO-3 run of the tests' `hf_bf16_2` spec (HF Trainer, 2 ranks,
bf16, 3 checkpoints), then for each case builds it on a fresh copy of that run and times the
command in a fresh process: wall time and peak RSS (the command's own, through wait4), the
exit code, and whether it left anything behind. The yardstick, measured in the same run, is the
CLI's own start-up (`tailor-tui --help`): a refusal costs that many start-ups. Cases over 5 s or
256 MiB, with another exit code than documented, a traceback, or files left, are flagged.

    python bench/bench_refusals.py [--repeats 3] [--cache .tailor-cache/bench] [--run DIR] [--only TEXT]

--run: a run of that spec already made (the tests' cache holds one: .tailor-cache/runs/hf_bf16_2-*).

Compare ratios between machines, not seconds.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))

from refusal_cases import CASES, snapshot, tailor_path  # noqa: E402
from runs import RunSpec, make_run  # noqa: E402

SPEC = RunSpec()  # tests/conftest.py's hf_bf16_2
SECONDS, PEAK = 5.0, 256 << 20

# Runs a command; writes its wall time and peak resident memory (wait4's) as JSON. Its own small
# process, so the command's peak is not the bench's (Linux keeps the pre-exec high-water mark).
MEASURE = ("import json, os, subprocess, sys, time\n"
           "t = time.perf_counter()\n"
           "p = subprocess.Popen(sys.argv[2:], stdin=subprocess.DEVNULL)\n"
           "_pid, status, usage = os.wait4(p.pid, 0)\n"
           "json.dump({'seconds': time.perf_counter() - t, 'peak': usage.ru_maxrss * 1024}, open(sys.argv[1], 'w'))\n"
           "sys.exit(os.waitstatus_to_exitcode(status))\n")


def measure(args: list, env: dict, timeout: float = 120) -> tuple[subprocess.CompletedProcess, float, int]:
    """(the finished command, its wall seconds, its peak RSS in bytes)."""
    with tempfile.TemporaryDirectory() as folder:
        out = Path(folder) / "measured.json"
        try:
            done = subprocess.run([sys.executable, "-c", MEASURE, str(out), tailor_path(), *map(str, args)],
                                  capture_output=True, text=True, timeout=timeout, stdin=subprocess.DEVNULL,
                                  env={**os.environ, "PYTHONWARNINGS": "ignore", **env})
        except subprocess.TimeoutExpired:
            return subprocess.CompletedProcess(args, -9, "", "timed out"), timeout, 0
        found = json.loads(out.read_text())
    return done, found["seconds"], found["peak"]


def run_case(name: str, source: Path) -> dict:
    with tempfile.TemporaryDirectory() as folder:
        tmp = Path(folder)
        run = tmp / "run"
        shutil.copytree(source, run, symlinks=True)
        case = CASES[name](run, tmp)
        before = snapshot(tmp)
        done, seconds, peak = measure(case.args, {"TAILOR_TUI_CACHE": str(tmp / "cache"), **case.env})
        errors = [line for line in done.stderr.splitlines() if line.startswith("error: ")]
        flags = []
        if done.returncode != case.code:
            flags.append(f"exit {done.returncode}, not {case.code}")
        if "Traceback" in done.stderr:
            flags.append("traceback")
        if case.code and len(errors) != 1:
            flags.append(f"{len(errors)} error lines")
        if case.code and snapshot(tmp) != before:
            flags.append("left files")
        return {"exit": done.returncode, "seconds": seconds, "peak": peak, "flags": flags,
                "error": errors[0] if errors else ""}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--cache", type=Path, default=ROOT / ".tailor-cache" / "bench")
    ap.add_argument("--run", type=Path, help="a run of the tests' hf_bf16_2 spec already made")
    ap.add_argument("--only", default="", help="only the cases whose name holds this text")
    args = ap.parse_args()
    source = args.run or args.cache / "refusals-hf-bf16-2"
    if not (source / "tailor_demo_spec.json").is_file():
        print(f"making the real ZeRO-3 run in {source} (once; a minute)…", flush=True)
        shutil.rmtree(source, ignore_errors=True)
        make_run(source, SPEC)
    with tempfile.TemporaryDirectory() as empty:
        help_times = [measure(["--help"], {"TAILOR_TUI_CACHE": empty})[1] for _ in range(max(5, args.repeats))]
    yardstick = statistics.median(help_times)
    print(f"yardstick: `tailor-tui --help` {yardstick:.3f} s (median of {len(help_times)}); each case built on a "
          f"fresh copy of the run, medians of {args.repeats}; flagged: over {SECONDS:.0f} s or {PEAK >> 20} MiB, "
          "another exit code, a traceback, files left")
    print(f"{'case':<66} {'exit':>4} {'seconds':>8} {'x --help':>8} {'peak MiB':>8}  flags")
    flagged = 0
    for name in CASES:
        if args.only not in name:
            continue
        runs = [run_case(name, source) for _ in range(args.repeats)]
        seconds, peak = statistics.median(r["seconds"] for r in runs), max(r["peak"] for r in runs)
        flags = sorted({f for r in runs for f in r["flags"]})
        flags += [f"over {SECONDS:.0f} s"] * (seconds > SECONDS) + [f"over {PEAK >> 20} MiB"] * (peak >= PEAK)
        flagged += bool(flags)
        print(f"{name:<66} {runs[0]['exit']:>4} {seconds:>8.2f} {seconds / yardstick:>8.1f} {peak / 2**20:>8.0f}  "
              f"{', '.join(flags) or 'ok'}", flush=True)
    print(f"{flagged} case(s) flagged")
    sys.exit(1 if flagged else 0)


if __name__ == "__main__":
    main()
