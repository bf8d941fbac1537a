"""The program output shown in README.md and docs/*.md, made by the program itself.

Every block between `<!-- sample: NAME -->` and `<!-- /sample -->` in those files is written
here: a command's block is the command line and what the real `tailor-tui` printed when this
script ran it on the demo run (`tailor-tui --make-demo`: HF Trainer, 2 ranks, its layers.2 NaN
before its last save); the `keys` block is the composer's own list of keys. docs/grid.svg is the composer's
snapshot that tests/test_snapshots.py checks against the running app.

    .venv/bin/python docs/samples.py                     rewrite every sample
    .venv/bin/python docs/samples.py --check             say which are out of date (exit 1)

The runs are those of the test-suite (tests/conftest.py: trained on CPU on first use, in seconds,
then cached in .tailor-cache/runs or $TAILOR_RUN_CACHE). The commands run in a
scratch folder holding a copy of it (demo-run/) and of recipes/, so the paths they
print are the ones a reader types. What varies from one run of a command to the next is set
aside when samples are compared (timings, rates, the worker count, which worker finished first);
a rewrite keeps a block whose only differences are those.

tests/test_readme.py runs the check.
"""

from __future__ import annotations

import argparse
import difflib
import os
import re
import shlex
import shutil
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
# the run the samples are made on: the demo run (`tailor-tui --make-demo` trains the same spec)
RUNS = {"demo-run": "demo"}
# files of docs/ that are copies of what the program makes (checked byte for byte)
COPIES = {ROOT / "docs" / "grid.svg": ROOT / "tests" / "__snapshots__" / "test_snapshots"
          / "test_health_heatmap[130x30].svg"}

SAMPLE = re.compile(r"(<!-- sample: (?P<name>[\w-]+) -->\n)(?P<body>.*?)(<!-- /sample -->)", re.S)


@dataclass(frozen=True)
class Command:
    """A command line as the reader types it, run in the scratch folder in this order."""

    name: str
    line: str
    stdout_only: bool = False  # leave out what goes to stderr (progress, notes)
    show_files: tuple[str, ...] = ()  # files shown after the output, as `$ cat FILE`
    tasks: int = 1  # run as that many tasks of a Slurm job step (the environment srun sets)


COMMANDS = (  # the README's walkthrough first, as a reader runs it after `make demo`
    Command("stats", "tailor-tui --stats demo-run", stdout_only=True),
    Command("heal", "tailor-tui --heal demo-run --recipe demo-run/fix.yaml", stdout_only=True,
            show_files=("demo-run/fix.yaml",)),
    Command("apply-fix", "tailor-tui --apply demo-run/fix.yaml"),
    Command("verify-fix", "tailor-tui --verify demo-run/fix.yaml", stdout_only=True),
    Command("srun", "srun --ntasks 2 tailor-tui --apply demo-run/fix.yaml --output demo-run/by-srun", tasks=2),
    Command("dry-run", "tailor-tui --apply recipes/demo.yaml --dry-run"),
    Command("apply", "tailor-tui --apply recipes/demo.yaml"),
    Command("export", "tailor-tui --export recipes/demo.yaml --to demo-run/eval-hf"),
    Command("export-dcp", "tailor-tui --export recipes/demo.yaml --to demo-run/eval-dcp --format dcp"),
    Command("world-size", "tailor-tui --apply recipes/demo.yaml --world-size 1 --output demo-run/one-rank"),
)

# launchers' variables: a sample run inside a Slurm job or under torchrun must not join it
_LAUNCHER = re.compile(r"^(SLURM_|TORCHELASTIC_|TAILOR_)|^(RANK|WORLD_SIZE|LOCAL_RANK|LOCAL_WORLD_SIZE|GROUP_RANK|"
                       r"MASTER_ADDR|MASTER_PORT)$")
_PROGRESS = re.compile(r"^(\[process \d+\] )?[^:]+: \d+% ")  # `rank 0: 41% 1.2 GiB/2.9 GiB`: a moment's state
_TASK_DONE = re.compile(r"^(\[process \d+\] )?(?!done:).+: done, ")  # finished in whatever order the workers did
_VOLATILE = [
    (re.compile(r" in \d+(\.\d+)?s, \d+(\.\d+)? (Bytes|[KMGT]iB)/s\)"), " in …s, … /s)"),  # timing and rate
    (re.compile(r"\d+ worker\(s\)"), "… worker(s)"),  # from the machine's cores and memory
]


def tailor_command() -> list[str]:
    exe = Path(sys.executable).with_name("tailor-tui")
    return [str(exe)] if exe.exists() else [sys.executable, "-m", "tailor_tui.cli.main"]


def environment(scratch: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not _LAUNCHER.search(k)}
    env.update(PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")])),
               PYTHONUNBUFFERED="1",  # stdout and stderr in the order they were written
               PYTHONWARNINGS="ignore",
               TAILOR_TUI_CACHE=str(scratch / ".cache"))  # statistics computed afresh, in this order
    return env


def run(command: Command, scratch: Path, env: dict[str, str]) -> str:
    """The command's output as shown: progress of the moment left out, finished tasks in order."""
    argv = shlex.split(command.line)
    argv = tailor_command() + argv[argv.index("tailor-tui") + 1:]
    streams = dict(stdout=subprocess.PIPE, stderr=subprocess.DEVNULL if command.stdout_only else subprocess.STDOUT)
    tasks = [subprocess.Popen(argv, cwd=scratch, text=True, **streams,
                              env={**env, "SLURM_PROCID": str(p), "SLURM_NTASKS": str(command.tasks),
                                   "SLURM_JOB_ID": "4242", "SLURM_STEP_ID": "0",
                                   "SLURM_STEP_NODELIST": "localhost"} if command.tasks > 1 else env)
             for p in range(command.tasks)]
    outputs = [task.communicate(timeout=300)[0] for task in tasks]
    for task, output in zip(tasks, outputs):
        if task.returncode != 0:
            raise SystemExit(f"sample {command.name}: `{command.line}` exited {task.returncode}:\n{output}")
    lines = [line for output in outputs for line in output.splitlines() if not _PROGRESS.match(line)]
    text = [f"$ {command.line}", *in_order(lines)]
    for name in command.show_files:
        text += [f"$ cat {name}", *(scratch / name).read_text().splitlines()]
    return "```console\n" + "\n".join(text) + "\n```\n"


def in_order(lines: list[str]) -> list[str]:
    """Each group of consecutive `TASK: done SIZE` lines sorted (rank 2 before rank 10)."""
    def key(line: str):
        return [int(part) if part.isdigit() else part for part in re.split(r"(\d+)", line.partition(": done, ")[0])]

    out: list[str] = []
    group: list[str] = []
    for line in lines + [""]:
        if _TASK_DONE.match(line):
            group.append(line)
            continue
        out += sorted(group, key=key) + [line]
        group = []
    return out[:-1]


def keys_table() -> str:
    """The composer's keys, by task, in its help screen's words (ui/actions.py)."""
    from tailor_tui.ui.actions import ACTIONS, GROUPS, screen_keys
    from tailor_tui.ui.app import SCREEN_KEYS

    rows = ["| | keys |", "|---|---|"]
    for group in GROUPS:
        keys = [f"`{a.key_text}` {a.help}" for a in ACTIONS if a.group == group and a.help]
        rows.append(f"| {group} | {' · '.join(keys)} |")
    screens = [f"{title[:1].lower()}{title[1:]}: {' · '.join(f'`{k}` {w}' for k, w in screen_keys(bindings))}"
               for title, bindings in SCREEN_KEYS]  # the screens over the grid, as the help lists them: one row
    rows.append(f"| dialogs | {'; '.join(screens)} |")
    return "\n".join(rows) + "\n"


def generate(runs: dict[str, Path] | None = None) -> dict[str, str]:
    """Every sample, by name. `runs`: the folders of RUNS' runs (default: the test-suite's cache)."""
    runs = runs or {folder: cached(name) for folder, name in RUNS.items()}
    samples = {"keys": keys_table()}
    with tempfile.TemporaryDirectory(prefix="tailor-samples-") as tmp:
        scratch = Path(tmp)
        for folder, source in runs.items():
            shutil.copytree(source, scratch / folder, symlinks=True)
        shutil.copytree(ROOT / "recipes", scratch / "recipes")
        env = environment(scratch)
        for command in COMMANDS:
            samples[command.name] = run(command, scratch, env)
    return samples


def cached(name: str) -> Path:
    """The test-suite's run `name`, made on first use (tests/conftest.py)."""
    sys.path[:0] = [str(ROOT), str(ROOT / "tests")]
    from conftest import cached_run

    return cached_run(name)


def comparable(text: str) -> str:
    for pattern, same in _VOLATILE:
        text = pattern.sub(same, text)
    return text


def update(samples: dict[str, str], write: bool) -> list[str]:
    """Differences between the pages' samples and `samples` (a unified diff each), and the copies'
    (a line each); `write`: rewrite what differs."""
    problems: list[str] = []
    for page in PAGES:
        text = page.read_text()
        rel = page.relative_to(ROOT)

        def fill(match: re.Match, rel: object = rel) -> str:
            name, body = match["name"], match["body"]
            if name not in samples:
                problems.append(f"{rel}: no sample is named '{name}' (docs/samples.py makes "
                                f"{', '.join(sorted(samples))})")
                return match[0]
            if comparable(body) == comparable(samples[name]):
                return match[0]  # the same but for what varies from run to run: left as it is
            problems.append("".join(difflib.unified_diff(body.splitlines(True), samples[name].splitlines(True),
                                                         f"{rel}: {name} (shown)", f"{rel}: {name} (now)")))
            return match[1] + samples[name] + match[4]

        new = SAMPLE.sub(fill, text)
        if write and new != text:
            page.write_text(new)
    for copy, original in COPIES.items():
        if not copy.is_file() or copy.read_bytes() != original.read_bytes():
            problems.append(f"{copy.relative_to(ROOT)}: not a copy of {original.relative_to(ROOT)}")
            if write:
                shutil.copyfile(original, copy)
    return problems


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--check", action="store_true", help="change nothing; exit 1 if a sample is out of date")
    args = ap.parse_args(argv)
    problems = update(generate(), write=not args.check)
    for problem in problems:
        print(problem)
    if args.check:
        return 1 if problems else 0
    print(f"{len(problems)} sample(s) rewritten" if problems else "every sample is up to date")
    return 0


if __name__ == "__main__":
    sys.exit(main())
