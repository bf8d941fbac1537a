"""`tailor-tui --make-demo DIR` (and the run `--demo` opens): a small real DeepSpeed ZeRO-3 run trained on CPU, made
once."""

from __future__ import annotations

import sys
from pathlib import Path

from tailor_tui.errors import ExitCode, OutputError
from tailor_tui.units import shown


def make_demo_command(args) -> int:
    out = args.make_demo
    ensure_demo(out)
    from tailor_tui.checkpoints.scan import training_checkpoints

    names = sorted((p.name for p in training_checkpoints(out)), key=lambda n: (len(n), n))
    print(shown(f"done: {out} holds the training checkpoints {', '.join(names)}"))  # never outputs, exports
    return ExitCode.OK


def ensure_demo(out: Path) -> None:
    """Train the demo run into `out` unless it is already there."""
    from tailor_tui.demo.demo_run import DEMO, SPEC_FILE, make_run

    spec = DEMO
    marker = out / SPEC_FILE
    if marker.is_file() and marker.read_text().strip() == spec.key():
        print(shown(f"demo run {out} already exists; reusing it"), file=sys.stderr)
        return
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise OutputError(f"{out}: already exists and is not empty; choose another folder for the demo run")
    print(shown(f"training a small real DeepSpeed ZeRO-3 run into {out} (HF Trainer, 2 ranks, CPU)…"), file=sys.stderr)
    make_run(out, spec)
