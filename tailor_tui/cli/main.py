"""`tailor-tui` command line: a thin layer over the backend and the TUI.

    tailor-tui RUN_DIR [--recipe fix.yaml]      the interactive composer
    tailor-tui --demo                           make a small real run and open it
    tailor-tui --apply recipe.yaml [--output DIR] [--workers N] [--dry-run] [--force] [--no-fsync] [--no-clone]
    tailor-tui --stats RUN_DIR [--json]           the health of every row in every checkpoint
    tailor-tui --heal RUN_DIR --recipe OUT.yaml   the recipe that takes every row where it is healthy
    tailor-tui --import LLMTAILOR.yaml --recipe OUT.yaml [--run RUN_DIR]   an LLMTailor recipe as tailor-tui's
    tailor-tui --make-demo DIR

Textual is imported only when the interactive composer starts: batch jobs on login
nodes (`--apply`) load the headless backend alone.
"""

from __future__ import annotations

import argparse
import importlib
import os
import signal
import sys
from pathlib import Path

from tailor_tui import __version__
from tailor_tui.errors import (
    ExitCode,
    TailorError,
    exit_codes_help,
)
from tailor_tui.units import WHOLE_NUMBER, clipped, shown, whole_number


def _positive(text: str) -> int:
    value = whole_number(text)  # the rule of every whole number a person writes (a recipe's too)
    if value is None or value < 1:
        raise argparse.ArgumentTypeError(f"expected a whole number of at least 1 ({WHOLE_NUMBER}), got '{clipped(text)}'")
    return value


def _positive_seconds(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = 0.0
    if not value > 0 or value == float("inf"):
        raise argparse.ArgumentTypeError(f"expected a number of seconds above 0, got '{text}'")
    return value


class _OneLineParser(argparse.ArgumentParser):
    """argparse, whose errors are one line as every user error is (not the usage, then the error)."""

    def error(self, message: str):  # argparse calls it and expects it not to return (exit does not)
        self.exit(ExitCode.USAGE, f"error: {shown(message)} ({self.prog} --help lists every option)\n")


def parser() -> argparse.ArgumentParser:
    p = _OneLineParser(
        prog="tailor-tui",
        description="Compose DeepSpeed ZeRO-3 checkpoints layer by layer.",
        epilog=exit_codes_help(),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("run_dir", nargs="?", type=Path, metavar="RUN_DIR",
                   help="open the interactive composer on a directory of ZeRO-3 checkpoints")
    p.add_argument("--recipe", type=Path, help="with RUN_DIR: load this recipe's picks (if it exists); ctrl+s saves "
                                               "there; with --heal or --import: where to write the recipe")
    mode = p.add_mutually_exclusive_group()
    mode.add_argument("--demo", action="store_true",
                      help="train a small real ZeRO-3 run into ./demo-run (once) and open the composer on it")
    mode.add_argument("--apply", metavar="RECIPE", type=Path, help="compose the checkpoint a recipe describes")
    mode.add_argument("--export", metavar="RECIPE", type=Path,
                      help="write the composition a recipe describes as a plain HF model folder (--to DIR), "
                           "for evaluation")
    mode.add_argument("--verify", metavar="RECIPE", type=Path,
                      help="re-check a finished output against its recipe and sources, row by row")
    mode.add_argument("--stats", metavar="RUN_DIR", type=Path,
                      help="the health of every row in every checkpoint (NaN/Inf, weight RMS, Adam's "
                           "exp_avg_sq max, change since the previous checkpoint), with each checkpoint's loss")
    mode.add_argument("--heal", metavar="RUN_DIR", type=Path,
                      help="write the recipe (--recipe OUT.yaml) that takes every row from the newest checkpoint "
                           "where it is healthy; base: the newest checkpoint")
    mode.add_argument("--import", metavar="RECIPE", type=Path,
                      help="write an LLMTailor (mergekit passthrough) recipe as a tailor-tui recipe (--recipe "
                           "OUT.yaml, else NAME.tailor-tui.yaml beside it; --force replaces it), showing each "
                           "row's source; --apply, --verify and "
                           "--export also read LLMTailor recipes as they are")
    mode.add_argument(
        "--make-demo",
        metavar="DIR",
        type=Path,
        help="train a small real DeepSpeed ZeRO-3 run on CPU (HF Trainer, 2 ranks) into DIR",
    )
    p.add_argument("--output", "-o", type=Path, help="output folder (overrides the recipe's `output`)")
    p.add_argument("--run", type=Path, metavar="RUN_DIR",
                   help="with an LLMTailor recipe: find each of its model paths in RUN_DIR by its last name "
                        "(checkpoint-N); without it, a path is taken as written, else beside the recipe")
    p.add_argument("--workers", "-j", type=_positive,
                   help="worker processes (default: from cores and memory); with --verify, reading threads "
                        "(default: one per core, at most 8)")
    p.add_argument("--world-size", type=_positive, metavar="M",
                   help="with --apply/--verify: compose for M data-parallel ranks (every source re-partitioned, "
                        "as DeepSpeed at world size M saves); overrides the recipe's world_size")
    p.add_argument("--dry-run", action="store_true", help="print the plan and write nothing")
    p.add_argument("--force", action="store_true",
                   help="replace an earlier tailor-tui output once the new one is complete "
                        "(never a folder tailor-tui did not write)")
    p.add_argument("--no-clone", dest="clone", action="store_false",
                   help="write every byte of the output, even where its filesystem could share the base's blocks "
                        "(XFS, Btrfs, OpenZFS: by default output files start as clones of the base's and only "
                        "the replaced rows are written)")
    p.add_argument("--no-fsync", dest="durable", action="store_false",
                   help="do not fsync the output before renaming it into place: faster on slow disks; still "
                        "atomic if tailor-tui is killed, but a power loss soon after can damage the output")
    p.add_argument(
        "--progress",
        choices=("auto", "bars", "lines"),
        default="auto",
        help="live bars (terminal) or plain periodic lines (logs); auto picks by whether stderr is a terminal",
    )
    p.add_argument("--to", type=Path, metavar="DIR", help="with --export: the folder to write the model to")
    p.add_argument("--format", choices=("hf", "dcp"), default=None,
                   help="with --export: hf (default), a plain HF model folder; dcp, a PyTorch Distributed "
                        "Checkpoint of the fp32 weights and the optimizer state (FSDP2's dcp.load + set_state_dict)")
    p.add_argument("--dtype", choices=("fp32", "bf16", "fp16"),
                   help="with --export: the weights' dtype (default: the training dtype)")
    p.add_argument("--max-shard-size", default="5GB", metavar="SIZE",
                   help="with --export: the largest safetensors file (default 5GB, as save_pretrained)")
    p.add_argument("--config", type=Path, metavar="PATH",
                   help="with --export: the model's config.json, or a folder with it and its tokenizer files "
                        "(default: an HF base checkpoint's own)")
    p.add_argument("--distributed", choices=("auto", "off"), default="auto",
                   help="with --apply, --stats or --heal: run as one job over the processes torchrun or srun "
                        "started (auto: when their environment says so); off: this process alone")
    p.add_argument("--peer-timeout", type=_positive_seconds, default=60.0, metavar="SECONDS",
                   help="in a job of several processes: how long one may stay silent (killed, hung, node "
                        "lost) before the whole job fails (default 60)")
    p.add_argument("--json", action="store_true", help="with --stats: print JSON instead of a table")
    p.add_argument("--check", action="store_true",
                   help="with --stats: exit 8 when any cell is unhealthy (NaN/Inf, CRC failure), for scripts")
    p.add_argument("--verbose", "-v", action="store_true",
                   help="with --verify: every difference of a failing row (default: its first and a count)")
    p.add_argument("--allow-nonfinite", action="store_true",
                   help="with --apply or --export: write the output even if it would hold NaN/Inf values (the "
                        "checkpoints' statistics say so before anything is written)")
    p.add_argument("--report-peak-rss", action="store_true",
                   help="after --apply or --stats, print the workers' peak resident memory (for benchmarks)")
    p.add_argument("--version", action="version", version=f"tailor-tui {__version__}")
    return p


def _crashed(exc: BaseException, args) -> int:
    """A bug: one line, its traceback in a log file (as the composer's)."""
    from tailor_tui.cli.crash import crash_line, log_crash

    action = next((f"--{name.replace('_', '-')}" for name in ACTIONS if getattr(args, name)), "tailor-tui")
    print(crash_line(exc, log_crash(exc), who=f"tailor-tui {action}"), file=sys.stderr)
    return ExitCode.INTERNAL


def _reader_gone(stream) -> bool:
    """Whether `stream` is a pipe whose reader has closed it (poll says POLLERR on its write end)."""
    import select

    try:
        poller = select.poll()
        poller.register(stream.fileno(), 0)
        return any(events & select.POLLERR for _fd, events in poller.poll(0))
    except (OSError, ValueError):
        return False


def _sigterm_as_interrupt(signum, frame):
    # Slurm's scancel and timeouts send SIGTERM: clean up exactly as for Ctrl-C.
    raise KeyboardInterrupt


ACTIONS = ("apply", "verify", "stats", "heal", "export", "import", "make_demo", "demo")  # the headless ones (not RUN_DIR)
# each action's command: (module, function), imported when it runs (`--demo` opens the composer: `main`)
COMMANDS = {
    "apply": ("tailor_tui.cli.apply_command", "apply_command"),
    "export": ("tailor_tui.cli.export_command", "export_command"),
    "verify": ("tailor_tui.cli.verify_command", "verify_command"),
    "stats": ("tailor_tui.cli.health_command", "stats_command"),
    "heal": ("tailor_tui.cli.health_command", "heal_command"),
    "import": ("tailor_tui.cli.import_command", "import_command"),
    "make_demo": ("tailor_tui.cli.demo_command", "make_demo_command"),
}
# options that only mean something beside one of some actions: (options, actions, why, if it says more), in the
# order the checks are made; each refused in one line when given without them
GOES_WITH = (
    (("json", "check"), ("stats",), ""),
    (("verbose",), ("verify",), ""),
    (("to", "format", "dtype", "config"), ("export",), ""),
    (("world_size",), ("apply", "verify"), ""),
    (("run",), ("apply", "verify", "export", "import"), "an LLMTailor recipe's run folder"),
)


def _goes_with(options: tuple[str, ...], actions: tuple[str, ...], why: str) -> str:
    """"--json and --check go with --stats": the line for options given without any of their actions."""
    def flags(names: tuple[str, ...], last: str) -> str:
        shown_ = [f"--{name.replace('_', '-')}" for name in names]
        return shown_[0] if len(shown_) == 1 else f"{', '.join(shown_[:-1])} {last} {shown_[-1]}"

    return (f"{flags(options, 'and')} {'goes' if len(options) == 1 else 'go'} with {flags(actions, 'or')}"
            + (f" ({why})" if why else ""))


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    signal.signal(signal.SIGTERM, _sigterm_as_interrupt)
    os.environ.setdefault("DS_ACCELERATOR", "cpu")  # no GPU needed to read checkpoints
    os.environ.setdefault("TORCH_CPP_LOG_LEVEL", "ERROR")  # (read as torch loads) no C++ stack frames per retry
    if any(getattr(args, name) for name in ACTIONS):
        if args.run_dir is not None:
            parser().error("RUN_DIR opens the interactive composer; it does not go with "
                           "--apply, --verify, --stats, --heal, --import, --make-demo or --demo")
    elif args.run_dir is None:
        parser().error("name a RUN_DIR to open, or use --demo, --apply RECIPE, --stats RUN_DIR or --make-demo DIR")
    for options, actions, why in GOES_WITH:
        if any(getattr(args, option) for option in options) and not any(getattr(args, a) for a in actions):
            parser().error(_goes_with(options, actions, why))
    if args.format == "dcp" and (args.dtype or args.config):
        parser().error("--dtype and --config go with --format hf: a DCP export holds the fp32 weights and the "
                       "optimizer state, and no config")
    try:
        action = next((name for name in ACTIONS if getattr(args, name)), None)
        if action == "demo":
            from tailor_tui.cli.composer_command import interactive
            from tailor_tui.cli.demo_command import ensure_demo

            ensure_demo(Path("demo-run"))
            code = interactive(Path("demo-run"), args.recipe, args.workers)  # as `tailor-tui demo-run` opens it
        elif action is not None:
            module, function = COMMANDS[action]
            code = getattr(importlib.import_module(module), function)(args)
        else:
            from tailor_tui.cli.composer_command import interactive

            assert args.run_dir is not None  # no action given: RUN_DIR is (the checks above)
            code = interactive(args.run_dir, args.recipe, args.workers)
    except TailorError as exc:
        print(f"error: {shown(exc)}", file=sys.stderr)  # one line, whatever names it holds
        code = exc.exit_code
    except KeyboardInterrupt:
        writes = args.apply or args.export or args.make_demo or args.demo
        print("error: cancelled" + ("; nothing was written to the output path" if writes else ""), file=sys.stderr)
        code = ExitCode.CANCELLED
    except BrokenPipeError as exc:
        if _reader_gone(sys.stdout):  # `--stats RUN | head`: the reader has seen enough
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
            code = ExitCode.OK
        else:  # a pipe of its own (a worker's) broke: not the reader's doing
            code = _crashed(exc, args)
    except Exception as exc:  # a bug: one line, its traceback in a log file (as the composer's)
        code = _crashed(exc, args)
    return int(code)


if __name__ == "__main__":
    sys.exit(main())
