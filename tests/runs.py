"""The tests' real training runs on CPU: every checkpoint the project is tested on was written by real DeepSpeed
(and, for the HF layout, by the real HF Trainer), never by hand. Test code: tailor-tui itself needs none of it.

A `RunSpec` is the demo's spec (`tailor_tui.demo.demo_run.DemoSpec`) with what the tests vary: the layout (the HF
Trainer's checkpoint-N folders, or DeepSpeed's save_dir tags written by a DeepSpeed engine here), the architecture
and its variants (`run_models`), the optimizer (`run_optimizers`), sub-groups, serialization, selective saves. An
HF-layout run is trained and resumed by the demo's own functions, through the spec's methods; a DeepSpeed-layout
run by this module's.

The same code makes runs with every DeepSpeed release tailor-tui reads (0.14 on) and under other interpreters:
`main` (`python tests/runs.py make OUT SPEC`, `resume CKPT SPEC RESAVE`) is what tests/conftest.py runs there.
"""

from __future__ import annotations

import json
import os
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from run_models import batch_inputs, build_model, collate, param_groups, trainer_dataset, training_batches
from run_models import run_trainer_class as _run_trainer_class
from run_optimizers import make_optimizer as _make_optimizer

from tailor_tui.demo import demo_run
from tailor_tui.demo.blowup import blow_up
from tailor_tui.demo.demo_run import DEMO, DemoSpec
from tailor_tui.demo.pinned import pin
from tailor_tui.demo.ranks import quiet, setup_rank, spawn_ranks

LATER_FIELDS = {"vision_layers": 0, "optimizer": "adamw"}  # fields added after run keys were first kept: defaults


@dataclass(frozen=True)
class RunSpec(DemoSpec):
    """What kind of training run to make: the demo's spec (`DemoSpec`: ranks, dtype, size, steps, blow-up, pinned)
    and what the tests vary."""

    # (`dtype` may be "fp16" too, in the DeepSpeed layout: DeepSpeed's CPU accelerator says fp16 is unsupported
    # unless the CPU has AVX512-FP16, and before 0.19 always; torch computes fp16 on any CPU, so runs lift that one
    # check: `allow_fp16_on_cpu`)
    tied: bool = False  # tie lm_head to embed_tokens
    # "hf": HF Trainer checkpoint-N folders; "deepspeed": save_dir tags; "accelerate": Accelerate's save_state
    # checkpoint_N folders (made by accelerate_run, not make_run)
    layout: str = "hf"
    sub_group_size: int | None = None  # ZeRO-3 sub_group_size; small values split groups
    frozen: tuple[str, ...] = ()  # parameters, or modules (all they hold), to freeze (frozen_param_fragments)
    intermediate: int | None = None  # MLP width; default 1.5 x hidden
    # False: DeepSpeed writes every .pt file in torch's legacy (non-zip) format
    # (`checkpoint: {checkpoint_serialization: false}`, DeepSpeed 0.17 and later)
    zip_serialization: bool = True
    # DeepSpeed layout: pass the DeepSpeed config as a JSON file's path, as scripts launched with
    # `--deepspeed_config ds.json` do (model_states then records that path, not a dict)
    config_file: bool = False
    # DeepSpeed layout: AdamW with amsgrad, which keeps a third per-element state (max_exp_avg_sq)
    amsgrad: bool = False
    # DeepSpeed layout: the optimizer, one of `run_optimizers.NAMES` ("adamw", "sgd" with momentum, "adagrad",
    # "rmsprop" with momentum, "adafactor", "lion"), each with its own state per element
    optimizer: str = "adamw"
    # a persistent buffer on the final norm (`model.norm.tailor_scale`): model_states keeps it in
    # `module` and save_pretrained writes it beside the weights
    buffer: bool = False
    # HF layout: evaluate at every save with `load_best_model_at_end`; the metric `score` is best
    # at step `best_at` (a test callback sets it in the evaluation's metrics; 0: no evaluation)
    best_at: int = 0
    save_total_limit: int | None = None  # HF layout: TrainingArguments.save_total_limit
    full_every: int = 0  # selective: the strategy's full_every
    # "parity" or "filter": save through tailor_tui.selective (the HF layout through its
    # Trainer callback); the run's checkpoints go to OUT/run, and full reference checkpoints
    # of every save, written by the same run, to OUT/reference
    selective: str | None = None
    arch: str = "llama"  # one of run_models.ARCHS
    peft: bool = False  # HF layout: train a PEFT LoRA adapter (run_models.lora_config)
    save_safetensors: bool = True  # HF layout: False writes pytorch_model.bin, as transformers 4.x did
    max_shard_size: str | None = None  # HF layout: shard the model file (e.g. "20KB")
    vision_layers: int = 0  # a vision-language model's vision encoder blocks (0: the arch's own default)
    extra: dict = field(default_factory=dict, hash=False, compare=False)

    def key_fields(self) -> dict[str, Any]:
        """A field added since keys were first kept (`LATER_FIELDS`) is left out at its default, so a run made
        before it keeps its key."""
        d = super().key_fields()
        d.pop("extra")
        for name, default in LATER_FIELDS.items():
            if d[name] == default:
                d.pop(name)
        return d

    def build_model(self):
        return build_model(self)

    def dataset(self) -> list[dict]:
        return trainer_dataset(self)

    def ds_config(self, for_trainer: bool = True) -> dict:
        cfg = super().ds_config(for_trainer)
        # ZeRO-3 keeps a gathered parameter while it is used again within this many elements of the trace;
        # looking that far ahead walks the whole rest of a tiny model at every release (DeepSpeed's default, 1e9
        # elements, is all of it): quadratic in its blocks, 14 s of the second step of a 52-block run. 0 releases
        # each at once; no tensor of the checkpoints depends on it (model_states keeps the setting: a few bytes)
        cfg["zero_optimization"]["stage3_max_reuse_distance"] = 0
        if self.sub_group_size:
            cfg["zero_optimization"]["sub_group_size"] = self.sub_group_size
        if self.dtype == "fp16":
            if for_trainer:
                raise ValueError("fp16 runs use the DeepSpeed layout (the HF Trainer refuses fp16 on CPU)")
            cfg["fp16"] = {"enabled": True, "initial_scale_power": 8}
        if not self.zip_serialization:
            cfg["checkpoint"] = {"checkpoint_serialization": False}
        if not for_trainer:
            cfg["gradient_clipping"] = 1.0
        return cfg

    def trainer_args(self, out: Path, max_steps: int, **more):
        best: dict[str, Any] = dict(eval_strategy="steps", eval_steps=self.save_every, load_best_model_at_end=True,
                                    metric_for_best_model="score", greater_is_better=True) if self.best_at else {}
        return super().trainer_args(out, max_steps, **best, save_total_limit=self.save_total_limit, **more)

    def resuming_trainer(self, args, callbacks: list, eval_dataset=None):
        """`RunTrainer` (`run_models`): the model file saved as the spec says."""
        return _run_trainer_class()(model=self.build_model(), args=args, train_dataset=self.dataset(),
                                    eval_dataset=eval_dataset, callbacks=list(callbacks), run_spec=self,
                                    data_collator=collate(self))

    def make_trainer(self, out: Path, max_steps: int, callbacks: list, *, newer_saves: str = "refuse"):
        """A selective run's checkpoints go to `out/run` (its Trainer callback saving them), full reference saves
        to `out/reference`; one evaluating at each save has its metric best at `best_at`."""
        made = self.resuming_trainer(self.trainer_args(out / "run" if self.selective else out, max_steps),
                                     [*callbacks, *([_best_at(self)] if self.best_at else [])],
                                     eval_dataset=self.dataset()[:8] if self.best_at else None)
        if self.selective:
            from tailor_tui.selective.hf import SelectiveCheckpointCallback

            made.add_callback(SelectiveCheckpointCallback(made, _strategy(self), newer_saves=newer_saves))
            made.add_callback(_reference_saves(made, self, out / "reference"))
            made.add_callback(_saves_seen(out / "on_save.txt"))
        return made

    def after_training(self, trainer, out: Path) -> None:
        if self.best_at:  # the weights training ended with (the best model's, loaded at the end)
            trainer.save_model(str(out / "final"))


# The demo run, as the tests' spec (`tailor-tui --make-demo` trains `demo_run.DEMO`, the same run)
DEMO_RUN = RunSpec(**DEMO.key_fields())


def make_optimizer(spec: RunSpec, groups):
    """The torch optimizer of a DeepSpeed-layout run of `spec` (ZeRO-3 keeps its state on flat partitions)."""
    return _make_optimizer(spec.optimizer, groups, amsgrad=spec.amsgrad)


def _engine(spec: RunSpec, model, folder: Path):
    """The DeepSpeed engine training `model` (a DeepSpeed-layout run of `spec`) with the client optimizer
    `make_optimizer` builds."""
    import deepspeed

    optimizer = make_optimizer(spec, param_groups(model))
    engine, *_ = deepspeed.initialize(model=model, optimizer=optimizer, config=_engine_config(spec, folder))
    return engine


def _engine_config(spec: RunSpec, folder: Path):
    """The `config` argument of deepspeed.initialize: a dict, or a JSON file's path."""
    cfg = spec.ds_config(for_trainer=False)
    if spec.optimizer != "adamw":  # (DeepSpeed's word for an optimizer of torch's it has no tests of)
        cfg["zero_allow_untested_optimizer"] = True
    if not spec.config_file:
        return cfg
    path = folder / "ds_config.json"
    tmp = path.with_name(f".ds_config.{os.getpid()}.json")  # every rank writes it: atomically
    tmp.write_text(json.dumps(cfg))
    os.replace(tmp, path)
    return str(path)


def allow_fp16_on_cpu() -> None:
    """Lift DeepSpeed's CPU accelerator's refusal of fp16 (`RunSpec.dtype`): DeepSpeed's own
    code still trains, scales the loss and saves; only its capability check is answered yes."""
    import torch
    from deepspeed.accelerator import get_accelerator

    accelerator = type(get_accelerator())
    supported = accelerator.supported_dtypes
    accelerator.is_fp16_supported = lambda self: True
    accelerator.supported_dtypes = lambda self: list(dict.fromkeys([*supported(self), torch.float16]))



def _train_rank(rank: int, world: int, port: int, spec: RunSpec, out: str | Path) -> None:
    """A rank of a DeepSpeed-layout run: a DeepSpeed engine, saving `global_stepN` tags."""
    quiet()
    setup_rank(rank, world, port)
    if spec.dtype == "fp16":
        allow_fp16_on_cpu()
    out = Path(out).absolute()
    engine = _engine(spec, build_model(spec), out)
    saver = None
    if spec.selective:
        from tailor_tui.selective.saver import SelectiveSaver

        saver = SelectiveSaver(_strategy(spec), out / "run")
    for step, ids in enumerate(training_batches(spec, spec.steps, rank), start=1):
        loss = engine(**batch_inputs(spec, ids)).loss
        engine.backward(loss)
        engine.step()
        if spec.pinned and step % spec.save_every == 0:
            pin(engine.module, step)
        if step == spec.blow_up_step:
            blow_up(engine.module, spec.blow_up)
        if step % spec.save_every == 0:
            if saver is None:
                engine.save_checkpoint(str(out), tag=f"global_step{step}")
            else:
                saver.save(engine, step)
                engine.save_checkpoint(str(out / "reference"), tag=f"global_step{step}")


def _best_at(spec: RunSpec):
    """Sets the evaluation's metric `eval_score`: 1.0 at step `best_at`, 0.0 elsewhere."""
    from transformers import TrainerCallback

    class BestAt(TrainerCallback):
        def on_evaluate(self, args, state, control, metrics=None, **kw):
            metrics["eval_score"] = 1.0 if state.global_step == spec.best_at else 0.0

    return BestAt()


def _saves_seen(record: Path):
    """Appends the step of every `on_save` event to `record` (the main process)."""
    from transformers import TrainerCallback

    class SavesSeen(TrainerCallback):
        def on_save(self, args, state, control, **kw):
            if args.should_save:
                with open(record, "a") as f:
                    f.write(f"{state.global_step}\n")

    return SavesSeen()


def _strategy(spec: RunSpec):
    from tailor_tui.selective.saver import Filter, Parity

    return Parity(full_every=spec.full_every) if spec.selective == "parity" else Filter(first=1, last=1)


def _reference_saves(trainer, spec: RunSpec, folder: Path):
    """A callback that writes, at every save step, what a full Trainer save holds (DeepSpeed's
    checkpoint and the 16-bit model file) to `folder/checkpoint-N`: what tests compare with."""
    from transformers import TrainerCallback

    class ReferenceSaves(TrainerCallback):
        def on_step_end(self, args, state, control, **kw):
            if state.global_step % spec.save_every == 0:
                target = str(folder / f"checkpoint-{state.global_step}")
                trainer.model_wrapped.save_checkpoint(target)
                trainer.save_model(target)

    return ReferenceSaves()


def make_run(out: str | Path, spec: RunSpec = RunSpec()) -> Path:
    """Train `spec` with real DeepSpeed ZeRO-3 and leave its checkpoints in `out`."""
    return demo_run.make_run(out, spec, train_rank=None if spec.layout == "hf" else _train_rank)


# --- resuming (to prove that composed checkpoints load) ------------------------------------


def _resume_rank(rank, world, port, spec: RunSpec, ckpt: str | Path, resave: str, result: str) -> None:
    """Load `ckpt` of a DeepSpeed-layout run the way a user resumes, re-save the loaded state, train one step."""
    quiet()
    setup_rank(rank, world, port)
    if spec.dtype == "fp16":
        allow_fp16_on_cpu()
    engine = _engine(spec, build_model(spec), Path(resave))
    if spec.optimizer == "adagrad":
        # DeepSpeed 0.19 cannot load a ZeRO-3 Adagrad checkpoint, its own untouched ones included: the Adagrad
        # it rebuilds holds every flat partition in its one group until the first step clears it, and loading
        # adds them again ("a parameter group that doesn't match the size"). Cleared first, as a step leaves it.
        engine.optimizer._clear_fp32_optimizer_param_groups()
    path, _ = engine.load_checkpoint(str(ckpt))
    if path is None:
        raise RuntimeError(f"DeepSpeed found no checkpoint in {ckpt}")
    engine.save_checkpoint(resave, tag="resaved")
    ids = training_batches(spec, 1, rank)[0]
    loss = engine(**batch_inputs(spec, ids)).loss
    engine.backward(loss)
    engine.step()
    if rank == 0:
        Path(result).write_text(json.dumps({"losses": [float(loss)]}))


def resume_and_step(ckpt: str | Path, spec: RunSpec, resave: str | Path) -> list[float]:
    """Resume real DeepSpeed (the HF Trainer for the HF layout: `demo_run.resume_and_step`) from `ckpt`. The state
    as loaded is re-saved under `resave/resaved`; returns the losses of the one training step that follows."""
    if spec.layout == "hf":
        return demo_run.resume_and_step(ckpt, spec, resave)
    return demo_run.resume_with(_resume_rank, ckpt, spec, resave)


def _continue_rank(rank, world, port, spec: RunSpec, out: str | Path, steps: int, resume: str, newer_saves: str,
                   resave: str | None, result: str) -> None:
    """Relaunch an HF selective run to `steps` in total, resuming as `resume` says."""
    quiet()
    setup_rank(rank, world, port)
    from transformers import TrainerCallback

    from tailor_tui.selective.run_saves import resume_point

    out = Path(out)

    class ResaveAtBegin(TrainerCallback):
        def on_train_begin(self, args, state, control, **kw):  # the state as loaded
            made.model_wrapped.save_checkpoint(resave, tag="resaved")

    made = demo_run.trainer(spec, out, steps, [ResaveAtBegin()] if resave else [], newer_saves=newer_saves)
    point = {"point": lambda: resume_point(out / "run"), "auto": lambda: True, "fresh": lambda: None}[resume]()
    made.train(resume_from_checkpoint=point)
    if rank == 0:
        Path(result).write_text(json.dumps({"resumed_from": point, "step": made.state.global_step}))


def continue_run(out: str | Path, spec: RunSpec, steps: int, *, resume: str = "point", newer_saves: str = "refuse",
                 resave: str | Path | None = None) -> dict:
    """Relaunch the HF selective run in `out` (made by make_run) to `steps` steps in total:
    `resume` "point" (resume_point), "auto" (resume_from_checkpoint=True) or "fresh". The state
    as loaded is saved to `resave/resaved` when given. Returns {"resumed_from", "step"}."""
    out = Path(out)
    result = out / "continued.json"
    spawn_ranks(_continue_rank, spec, str(out), steps, resume, newer_saves, str(resave) if resave else None,
                str(result))
    return json.loads(result.read_text())


def main(argv: list[str] | None = None) -> None:
    """`python tests/runs.py make OUT SPEC`, `resume CKPT SPEC RESAVE` (SPEC: a RunSpec.key()): how the tests make
    and resume runs under another DeepSpeed release or interpreter."""
    args = sys.argv[1:] if argv is None else argv
    if len(args) == 3 and args[0] == "make":
        make_run(args[1], RunSpec.from_key(args[2]))
    elif len(args) == 4 and args[0] == "resume":
        print(json.dumps(resume_and_step(args[1], RunSpec.from_key(args[2]), args[3])))
    else:
        raise SystemExit("usage: python tests/runs.py make OUT SPEC | resume CKPT SPEC RESAVE")


if __name__ == "__main__":
    import runs  # this file as the module `runs`: where the ranks find the functions they run

    runs.main()
