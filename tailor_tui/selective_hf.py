"""Selective checkpointing for the HF Trainer: one callback, one line in a training script.

    from tailor_tui.selective import Parity
    from tailor_tui.selective_hf import SelectiveCheckpointCallback

    trainer = Trainer(model=model, args=args, train_dataset=data)   # args.deepspeed: ZeRO-3
    trainer.add_callback(SelectiveCheckpointCallback(trainer, Parity()))
    trainer.train()

The Trainer still decides when to save (save_steps, save_strategy, the end of training);
at each of those saves the strategy decides what is saved. A full save is the Trainer's
own `checkpoint-N`, untouched. Otherwise the callback cancels the Trainer's save and
writes `OUTPUT_DIR/partial-stepN/` instead: each rank's slices of the chosen rows
(`tailor_tui.selective.save_rows`, no gather) plus what a Trainer checkpoint holds besides
weights: `trainer_state.json`, `scheduler.pt`, each rank's `rng_state_R.pth`,
`training_args.bin`, the model config and tokenizer, and a record of the 16-bit model
files' layout (headers and index of the newest full checkpoint's `model.safetensors`), so a
composed output gets the same model files a full save writes.

Partial folders are not named `checkpoint-N`, so the Trainer's own checkpoint rotation
(`save_total_limit`) and `resume_from_checkpoint=True` never take one for a checkpoint;
compose them with `tailor-tui OUTPUT_DIR` and resume from the composed folder.
"""

from __future__ import annotations

from pathlib import Path

from transformers import TrainerCallback

from .checkpoint import PARTIAL_MODEL_FILES, hf_model_files
from .model_files import ModelFileLayout
from .selective import model_rows, save_rows


class SelectiveCheckpointCallback(TrainerCallback):
    """Applies a strategy (`Parity`, `Filter`) to the Trainer's saves; see the module doc."""

    def __init__(self, trainer, strategy):
        self.trainer, self.strategy, self.saves = trainer, strategy, 0

    def on_step_end(self, args, state, control, **kwargs):
        return self._save_if_partial(args, state, control)

    def on_epoch_end(self, args, state, control, **kwargs):
        return self._save_if_partial(args, state, control)

    def _save_if_partial(self, args, state, control):
        if not control.should_save:
            return control
        engine = self.trainer.model_wrapped
        if not hasattr(engine, "zero_optimization_stage"):
            raise ValueError("SelectiveCheckpointCallback needs a DeepSpeed ZeRO-3 run "
                             "(TrainingArguments(deepspeed=...) with zero_optimization.stage 3)")
        rows = self.strategy.rows_for(self.saves, model_rows(engine))
        self.saves += 1
        if rows is None:
            return control  # a full save: the Trainer writes its own checkpoint-N
        control.should_save = False  # this save is ours
        save_rows(engine, args.output_dir, rows, step=state.global_step, layout="hf",
                  write_extra=self._write_trainer_files)
        return control

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
        trainer.state.save_to_json(str(folder / "trainer_state.json"))
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
