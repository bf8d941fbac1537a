"""The README and docs/ say what the program does: their samples are its output (docs/samples.py
runs the commands again), every command line they show parses, every link and anchor leads somewhere,
every `from tailor_tui… import …` resolves, and the exit codes are those of errors.py."""

from __future__ import annotations

import ast
import importlib.util
import re
import shlex
import sys
from pathlib import Path

import pytest

from tailor_tui.cli.main import parser
from tailor_tui.errors import ExitCode

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
PAGES = [README, *sorted((ROOT / "docs").glob("*.md"))]
FENCE = re.compile(r"^```(\w*)\n(.*?)^```", re.M | re.S)


def _samples():
    spec = importlib.util.spec_from_file_location("docs_samples", ROOT / "docs" / "samples.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


def test_the_readme_starts_with_make_demo_and_make_test_and_stays_short():
    lines = README.read_text().splitlines()
    assert lines[:3] == ["# tailor-tui", "", "```sh"]
    assert lines[3].startswith("make demo ") and lines[4].startswith("make test ") and lines[5] == "```"
    assert len(lines) <= 400, f"README.md has {len(lines)} lines; move detail to docs/"


def test_the_samples_are_what_the_program_prints(real_run):
    """Every sample block, run again on the same real runs, reads the same (timings aside); the
    screenshot is the snapshot test_snapshots.py checks against the app."""
    samples = _samples()
    runs = {folder: real_run(name)[0] for folder, name in samples.RUNS.items()}
    problems = samples.update(samples.generate(runs), write=False)
    assert not problems, "\n".join(problems) + "\nrewrite them with: .venv/bin/python docs/samples.py"


def test_a_runs_files_do_not_depend_on_the_folder_it_was_made_in(real_run):
    """The HF Trainer pickles its arguments, output_dir among them, into every checkpoint (training_args.bin):
    runs give it relative to the run's folder, so the samples' sizes do not depend on where the suite's run
    cache lies (a cache at another path once changed a sample's size by 0.1 KiB)."""
    from conftest import checkpoints_of

    run, spec = real_run("demo")
    for ckpt in checkpoints_of(run, spec):
        pickled = (ckpt / "training_args.bin").read_bytes()  # (torch's archive stores its records as they are)
        assert b"output_dir" in pickled and str(run.resolve()).encode() not in pickled, ckpt


def _shell_commands(text: str):
    """Every command line of the page's sh, bash and console blocks (console: the `$ ` lines), as
    tokens, split at `&&`, `||`, `;` and `|`."""
    for lang, body in FENCE.findall(text):
        if lang not in ("sh", "bash", "console", "shell"):
            continue
        for line in body.replace("\\\n", " ").splitlines():
            if lang == "console":
                if not line.startswith("$ "):
                    continue
                line = line[2:]
            command: list[str] = []
            for token in shlex.split(line, comments=True) + [";"]:
                if token in ("&&", "||", ";", "|"):
                    if command:
                        yield command
                    command = []
                else:
                    command.append(token)


def test_every_command_line_shown_parses():
    """`tailor-tui …` lines use only options that exist, with values they accept; `make X`
    names a target of the Makefile."""
    targets = set(re.findall(r"^([\w-]+):", (ROOT / "Makefile").read_text(), re.M))
    options = parser()._option_string_actions  # exactly these: not argparse's abbreviations
    seen = 0
    for page in PAGES:
        for command in _shell_commands(page.read_text()):
            if command[0] == "make":
                assert set(command[1:]) <= targets, f"{page.name}: {' '.join(command)}: no such make target"
            at = [i for i, token in enumerate(command) if token == "tailor-tui" or token.endswith("/tailor-tui")]
            if not at:
                continue
            args = command[at[0] + 1:]
            seen += 1
            unknown = [a for a in args if a.startswith("-") and a.split("=")[0] not in options]
            assert not unknown, f"{page.name}: `tailor-tui {' '.join(args)}`: no option {', '.join(unknown)}"
            try:
                parser().parse_args(args)
            except SystemExit as exc:
                if exc.code:
                    pytest.fail(f"{page.name}: `tailor-tui {' '.join(args)}` does not parse")
    assert seen >= 20


def _slug(heading: str) -> str:
    """The anchor GitHub gives a heading."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def _anchors(page: Path) -> set[str]:
    text = FENCE.sub("", page.read_text())
    return {_slug(h) for h in re.findall(r"^#{1,6} (.+)$", text, re.M)}


def test_every_link_and_anchor_resolves():
    for page in PAGES:
        text = FENCE.sub("", page.read_text())
        for target in re.findall(r"\]\(([^)\s]+)\)", text):
            if re.match(r"[a-z]+:", target):
                continue
            path, _, anchor = target.partition("#")
            file = (page.parent / path).resolve() if path else page
            assert file.exists(), f"{page.name}: link to {target}: no such file"
            if anchor:
                assert anchor in _anchors(file), f"{page.name}: link to {target}: no such heading"


def _top_level_names(module: str) -> set[str]:
    spec = importlib.util.find_spec(module)
    assert spec is not None and spec.origin, f"no module {module}"
    tree = ast.parse(Path(spec.origin).read_text())
    names = set()
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            names |= {(alias.asname or alias.name).split(".")[0] for alias in node.names}
        elif isinstance(node, (ast.Assign, ast.AnnAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            names |= {t.id for t in targets if isinstance(t, ast.Name)}
    if spec.submodule_search_locations is not None:  # a package's public API, found in its modules when used
        names |= set(getattr(importlib.import_module(module), "__all__", ()))
    return names


def test_every_tailor_tui_import_shown_exists():
    seen = 0
    for page in PAGES:
        for lang, body in FENCE.findall(page.read_text()):
            if lang != "python":
                continue
            for node in ast.walk(ast.parse(body)):
                if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("tailor_tui"):
                    missing = {a.name for a in node.names} - _top_level_names(node.module)
                    assert not missing, f"{page.name}: {node.module} has no {', '.join(sorted(missing))}"
                    seen += len(node.names)
    assert seen >= 6


def test_the_exit_codes_are_those_of_the_program():
    section = README.read_text().split("## Exit codes", 1)[1].split("\n## ", 1)[0]
    shown = {int(code) for code in re.findall(r"^\| `(\d+)` \|", section, re.M)}
    assert shown == {int(code) for code in ExitCode}
