"""Selective checkpointing for the HF Trainer: one callback, one line in a training script.

    from tailor_tui.selective.run_saves import resume_point
    from tailor_tui.selective.saver import Parity
    from tailor_tui.selective.hf import SelectiveCheckpointCallback

    trainer = Trainer(model=model, args=args, train_dataset=data)   # args.deepspeed: ZeRO-3
    trainer.add_callback(SelectiveCheckpointCallback(trainer, Parity()))
    trainer.train(resume_from_checkpoint=resume_point(args.output_dir))

The Trainer still decides when to save (save_steps, save_strategy, the end of training,
epochs); at each save the strategy decides what is saved. The callback takes over the
Trainer's own save step (`Trainer._save_checkpoint`), so a save happens where the
Trainer's would: after that step's logging and evaluation, followed by every callback's
`on_save`. A full save is the Trainer's own `checkpoint-N`, untouched. Otherwise the
callback writes `OUTPUT_DIR/partial-stepN/`: each rank's slices of the chosen rows
(`tailor_tui.selective.save_rows`, no gather) plus what a Trainer checkpoint holds besides
weights: `trainer_state.json`, `scheduler.pt`, each rank's `rng_state_R.pth`,
`training_args.bin`, the model config and tokenizer, and a record of the 16-bit model
files' layout (headers and index of the newest full checkpoint's `model.safetensors`), so a
composed output gets the same model files a full save writes.

What the Trainer's other machinery needs is kept:
- `load_best_model_at_end`: a save at a new best metric is always full (and recorded as
  the best), so the best model loaded at the end is that step's.
- Resuming: `resume_point(output_dir)` composes the newest state when partial saves are
  newer than the newest full checkpoint. Training that starts from an older state than
  the newest save in `output_dir` (`resume_from_checkpoint=True` picks the newest
  `checkpoint-N`, which partial saves do not update) is refused at its start, unless
  `newer_saves="set_aside"` (they are moved into `OUTPUT_DIR/set-aside-TIME/`). The
  strategy's schedule goes on from the save the run resumed from (it is recorded in
  `trainer_state.json`), and a save never replaces a partial folder of another run.
- `save_total_limit`: besides the Trainer's own rotation of `checkpoint-N`, saves that no
  longer hold the newest copy of any row and are not among the newest N go, never the
  newest full checkpoint nor the best model's.
"""

from __future__ import annotations

import logging
import shutil
import uuid
from pathlib import Path

from transformers import TrainerCallback

from tailor_tui.checkpoints.checkpoint import hf_model_files
from tailor_tui.checkpoints.model_layout import ModelFileLayout
from tailor_tui.kinds.folders import TRAINER_STATE
from tailor_tui.kinds.partial import PARTIAL_MODEL_FILES
from tailor_tui.selective.run_saves import barrier, newer_than, removable, run_saves, set_aside
from tailor_tui.selective.saver import model_rows, save_rows

SCHEDULE = "SelectiveCheckpointSchedule"  # trainer_state.json stateful_callbacks: saves so far, lineage
RESUME_HINT = "trainer.train(resume_from_checkpoint=resume_point(args.output_dir))"
log = logging.getLogger(__name__)


class StaleStartError(RuntimeError):
    """Training would start from an older state than the newest save in its output_dir."""


class SelectiveCheckpointCallback(TrainerCallback):
    """Applies a strategy (`Parity`, `Filter`) to the Trainer's saves; see the module doc."""

    def __init__(self, trainer, strategy, *, newer_saves: str = "refuse"):
        if newer_saves not in ("refuse", "set_aside"):
            raise ValueError(f"newer_saves must be 'refuse' or 'set_aside', not {newer_saves!r}")
        self.trainer, self.strategy, self.newer_saves = trainer, strategy, newer_saves
        self.saves = 0  # saves of this run so far, full and partial: the strategy's schedule
        self.lineage = uuid.uuid4().hex  # this run's, kept across resumes
        self._full_save = trainer._save_checkpoint
        trainer._save_checkpoint = self._save_checkpoint  # the Trainer's save step is ours

    def on_train_begin(self, args, state, control, **kwargs):
        record = (state.stateful_callbacks or {}).get(SCHEDULE)
        if isinstance(record, dict):  # resumed from a save of this callback: go on with its schedule
            self.saves = int(record.get("saves", 0))
            self.lineage = str(record.get("lineage") or self.lineage)
        if args.save_strategy == "best" and args.load_best_model_at_end:
            log.warning("SelectiveCheckpointCallback: with save_strategy='best' and load_best_model_at_end "
                        "every save is a new best, and a best is always saved in full: nothing is left out")
        newer = newer_than(run_saves(args.output_dir), state.global_step)
        barrier()  # every process has looked before the main one moves anything
        if not newer:
            return control
        names = ", ".join(s.path.name for s in newer)
        if self.newer_saves == "refuse":
            raise StaleStartError(
                f"training starts at step {state.global_step}, but {args.output_dir} holds newer saves "
                f"({names}); resume the newest state with {RESUME_HINT}, or pass "
                "SelectiveCheckpointCallback(..., newer_saves='set_aside') to train on from here")
        if args.should_save:
            folder = set_aside(Path(args.output_dir), newer)
            log.warning("SelectiveCheckpointCallback: saves newer than step %d (%s) set aside in %s",
                        state.global_step, names, folder)
        barrier()
        return control

    def _save_checkpoint(self, model, trial) -> None:
        trainer = self.trainer
        args, state = trainer.args, trainer.state
        engine = trainer.model_wrapped
        if not hasattr(engine, "zero_optimization_stage"):
            raise ValueError("SelectiveCheckpointCallback needs a DeepSpeed ZeRO-3 run "
                             "(TrainingArguments(deepspeed=...) with zero_optimization.stage 3)")
        rows = self.strategy.rows_for(self.saves, model_rows(engine))
        best = args.load_best_model_at_end and state.best_global_step == state.global_step
        self.saves += 1
        state.stateful_callbacks[SCHEDULE] = {"saves": self.saves, "lineage": self.lineage}
        if rows is None or best:
            self._full_save(model, trial)  # the Trainer's own checkpoint-N (and its rotation)
        else:
            save_rows(engine, args.output_dir, rows, step=state.global_step, layout="hf",
                      write_extra=self._write_trainer_files, lineage=self.lineage)
        if args.save_total_limit and args.should_save:
            best_dir = state.best_model_checkpoint
            for save in removable(run_saves(args.output_dir), args.save_total_limit,
                                  {Path(best_dir)} if best_dir else set()):
                log.info("SelectiveCheckpointCallback: deleting %s (save_total_limit)", save.path)
                shutil.rmtree(save.path, ignore_errors=True)

    def _write_trainer_files(self, folder: Path) -> None:
        """What Trainer._save_checkpoint writes besides weights and optimizer; every rank."""
        import torch
        from accelerate.utils import DeepSpeedSchedulerWrapper
        from transformers.trainer_callback import ExportableState

        trainer = self.trainer
        trainer.store_flos()  # a collective: every rank, as a full save does
        trainer._save_rng_state(str(folder))  # rng_state_R.pth of this rank, HF's own format
        if not trainer.args.should_save:
            return
        model = trainer.accelerator.unwrap_model(trainer.model)
        model.config.save_pretrained(folder)
        if model.can_generate() and getattr(model, "generation_config", None) is not None:
            model.generation_config.save_pretrained(folder)
        if trainer.processing_class is not None:
            trainer.processing_class.save_pretrained(folder)
        torch.save(trainer.args, folder / "training_args.bin")
        if not isinstance(trainer.lr_scheduler, DeepSpeedSchedulerWrapper):
            # the Trainer keeps its own scheduler outside DeepSpeed's files in this case
            torch.save(trainer.lr_scheduler.state_dict(), folder / "scheduler.pt")
        for cb in [*trainer.callback_handler.callbacks, trainer.control]:
            if isinstance(cb, ExportableState):
                exported = cb.state()
                if cb is trainer.control:  # as the Trainer's own save records it
                    exported["args"]["should_save"] = True
                name = cb.__class__.__name__
                if isinstance(trainer.state.stateful_callbacks.get(name), list):
                    trainer.state.stateful_callbacks[name].append(exported)
                else:
                    trainer.state.stateful_callbacks[name] = exported
        trainer.state.save_to_json(str(folder / TRAINER_STATE))
        layout = self._model_file_layout(Path(trainer.args.output_dir))
        if layout is not None:
            (folder / PARTIAL_MODEL_FILES).write_text(layout.to_json())

    @staticmethod
    def _model_file_layout(output_dir: Path) -> ModelFileLayout | None:
        """The newest full checkpoint's 16-bit model files, headers only (every save of a run
        has the same layout); None before the first full save."""
        from transformers.trainer_utils import get_last_checkpoint

        last = get_last_checkpoint(str(output_dir)) if output_dir.is_dir() else None
        files = hf_model_files(Path(last)) if last else ()
        return ModelFileLayout.of_files(files) if files else None


