"""Make small but real DeepSpeed ZeRO-3 training runs on a CPU-only machine.

Used by `tailor-tui --make-demo` and by the test-suite: every checkpoint the
project is tested on was written by real DeepSpeed (and, for the HF layout, by
the real HF Trainer), never by hand.

Each rank is a process started with torch.multiprocessing (`ranks.spawn_ranks`:
forked from a server that imported torch, DeepSpeed and the Trainer once) on the
gloo backend. Two settings keep this to seconds instead of minutes of C++ op
builds: a client `torch.optim.AdamW` (no `optimizer` block in the DeepSpeed
config) and disabling the shared-memory comm op before init_distributed.

The same code makes runs with every DeepSpeed release tailor-tui reads (0.14 on;
tests/test_compat.py runs it with each release in turn).
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from tailor_tui.kinds.folders import TRAINER_STATE
from tailor_tui.runs import optimizers
from tailor_tui.runs.blowup import blow_up, blow_up_callback
from tailor_tui.runs.models import (  # noqa: F401
    batch_inputs,
    build_model,
    make_trainer,
    model_config,
    param_groups,
    trainer_dataset,
    training_batches,
)
from tailor_tui.runs.pinned import first_callback, pin, pin_callback

# the models, datasets and Trainer of the runs; model_config is re-exported for the tests
from tailor_tui.runs.ranks import quiet, setup_rank, spawn_ranks

VOCAB = 101  # prime, so embedding and lm_head never split evenly across ranks


LATER_FIELDS = {"vision_layers": 0, "optimizer": "adamw"}  # RunSpec's fields added after run keys were first kept: their defaults


@dataclass(frozen=True)
class RunSpec:
    """What kind of training run to make."""

    world_size: int = 2
    # "bf16", "fp32", or "fp16" (DeepSpeed layout: DeepSpeed's CPU accelerator says fp16 is
    # unsupported unless the CPU has AVX512-FP16, and before 0.19 always; torch computes fp16 on
    # any CPU, so runs lift that one check: `_allow_fp16_on_cpu`)
    dtype: str = "bf16"
    tied: bool = False  # tie lm_head to embed_tokens
    # "hf": HF Trainer checkpoint-N folders; "deepspeed": save_dir tags; "accelerate": Accelerate's
    # save_state checkpoint_N folders (made by the tests' accelerate_run, not make_run)
    layout: str = "hf"
    layers: int = 4
    hidden: int = 32
    steps: int = 6
    save_every: int = 2
    sub_group_size: int | None = None  # ZeRO-3 sub_group_size; small values split groups
    frozen: tuple[str, ...] = ()  # parameters, or modules (all they hold), to freeze (frozen_param_fragments)
    seed: int = 0
    vocab: int = VOCAB
    intermediate: int | None = None  # MLP width; default 1.5 x hidden
    # False: DeepSpeed writes every .pt file in torch's legacy (non-zip) format
    # (`checkpoint: {checkpoint_serialization: false}`, DeepSpeed 0.17 and later)
    zip_serialization: bool = True
    # DeepSpeed layout: pass the DeepSpeed config as a JSON file's path, as scripts launched with
    # `--deepspeed_config ds.json` do (model_states then records that path, not a dict)
    config_file: bool = False
    # make these parameters "blow up" just before the save at step `blow_up_step` (`blowup`):
    # their fp32 master weights and exp_avg_sq become NaN through DeepSpeed's own ZeRO-3 API
    # (safe_set_full_fp32_param / safe_set_full_optimizer_state); training goes on from there
    blow_up: tuple[str, ...] = ()
    blow_up_step: int = 0
    # just before every save, every parameter's weights and Adam moments, and the logged loss and grad
    # norm, are set to known values through DeepSpeed's own API (`pinned`): the numbers shown of the
    # run are the same on every CPU (the demo, the README's samples, the snapshot tests)
    pinned: bool = False
    # DeepSpeed layout: AdamW with amsgrad, which keeps a third per-element state (max_exp_avg_sq)
    amsgrad: bool = False
    # DeepSpeed layout: the optimizer, one of `optimizers.NAMES` ("adamw", "sgd" with momentum, "adagrad", "rmsprop"
    # with momentum, "adafactor", "lion"), each with its own state per element
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
    arch: str = "llama"  # "llama", "opt", "bert", "t5" or "gpt_neox" (tailor_tui.runs.models)
    peft: bool = False  # HF layout: train a PEFT LoRA adapter (run_models.lora_config)
    save_safetensors: bool = True  # HF layout: False writes pytorch_model.bin, as transformers 4.x did
    max_shard_size: str | None = None  # HF layout: shard the model file (e.g. "20KB")
    vision_layers: int = 0  # a vision-language model's vision encoder blocks (0: the arch's own default)
    extra: dict = field(default_factory=dict, hash=False, compare=False)

    def key(self) -> str:
        """A stable name for caching runs made from this spec (`from_key` reads it back); a field
        added since keys were first kept (`LATER_FIELDS`) is left out at its default, so a run made
        before it keeps its key."""
        d = asdict(self)
        d.pop("extra")
        for name, default in LATER_FIELDS.items():
            if d[name] == default:
                d.pop(name)
        return json.dumps(d, sort_keys=True)

    @classmethod
    def from_key(cls, text: str) -> "RunSpec":
        d = json.loads(text)
        fields: dict[str, Any] = {k: tuple(v) if isinstance(v, list) else v for k, v in d.items()}
        return cls(**fields)


# The demo run (`tailor-tui --demo`, `--make-demo`): HF Trainer, 2 ranks, bf16, checkpoints at
# steps 2, 4, 6; layer 2 blows up just before the last save, so there is something to heal. Pinned:
# it shows the same numbers on every machine, those of the README.
DEMO = RunSpec(blow_up=("model.layers.2.mlp.down_proj.weight", "model.layers.2.self_attn.q_proj.weight"),
               blow_up_step=6, pinned=True)


def ds_config(spec: RunSpec, for_trainer: bool) -> dict:
    zero = {"stage": 3, "stage3_gather_16bit_weights_on_model_save": True}
    if spec.sub_group_size:
        zero["sub_group_size"] = spec.sub_group_size
    cfg: dict[str, Any] = {
        "train_micro_batch_size_per_gpu": "auto" if for_trainer else 2,
        "gradient_accumulation_steps": "auto" if for_trainer else 1,
        "zero_optimization": zero,
        "bf16": {"enabled": spec.dtype == "bf16"},
        "steps_per_print": 10**9,
    }
    if spec.dtype == "fp16":
        if for_trainer:
            raise ValueError("fp16 runs use the DeepSpeed layout (the HF Trainer refuses fp16 on CPU)")
        cfg["fp16"] = {"enabled": True, "initial_scale_power": 8}
    if not spec.zip_serialization:
        cfg["checkpoint"] = {"checkpoint_serialization": False}
    if not for_trainer:
        cfg["gradient_clipping"] = 1.0
    return cfg


def make_optimizer(spec: RunSpec, groups):
    """The torch optimizer of a DeepSpeed-layout run of `spec` (ZeRO-3 keeps its state on flat partitions)."""
    return optimizers.make_optimizer(spec.optimizer, groups, amsgrad=spec.amsgrad)


def _engine(spec: RunSpec, model, folder: Path):
    """The DeepSpeed engine training `model` (a DeepSpeed-layout run of `spec`) with the client optimizer
    `make_optimizer` builds."""
    import deepspeed

    optimizer = make_optimizer(spec, param_groups(model))
    engine, *_ = deepspeed.initialize(model=model, optimizer=optimizer, config=_engine_config(spec, folder))
    return engine


def _engine_config(spec: RunSpec, folder: Path):
    """The `config` argument of deepspeed.initialize: a dict, or a JSON file's path."""
    cfg = ds_config(spec, for_trainer=False)
    if spec.optimizer != "adamw":  # (DeepSpeed's word for an optimizer of torch's it has no tests of)
        cfg["zero_allow_untested_optimizer"] = True
    if not spec.config_file:
        return cfg
    path = folder / "ds_config.json"
    tmp = path.with_name(f".ds_config.{os.getpid()}.json")  # every rank writes it: atomically
    tmp.write_text(json.dumps(cfg))
    os.replace(tmp, path)
    return str(path)


def _trainer_args(spec: RunSpec, out: Path, max_steps: int):
    from transformers import TrainingArguments

    best: dict[str, Any] = dict(eval_strategy="steps", eval_steps=spec.save_every, load_best_model_at_end=True,
                metric_for_best_model="score", greater_is_better=True) if spec.best_at else {}
    return TrainingArguments(
        **best,
        save_total_limit=spec.save_total_limit,
        output_dir=str(out),
        per_device_train_batch_size=2,
        max_steps=max_steps,
        save_steps=spec.save_every,
        save_strategy="steps",
        learning_rate=1e-3,
        weight_decay=0.1,
        bf16=spec.dtype == "bf16",
        deepspeed=ds_config(spec, for_trainer=True),
        report_to=[],
        logging_steps=1,
        ddp_backend="gloo",
        use_cpu=True,
        dataloader_num_workers=0,
        disable_tqdm=True,
        seed=spec.seed,
        data_seed=spec.seed,
    )


def _train_rank(rank: int, world: int, port: int, spec: RunSpec, out: str | Path) -> None:
    quiet()
    setup_rank(rank, world, port, spec)
    out = Path(out).absolute()
    if spec.layout == "hf":
        # The Trainer pickles its arguments, output_dir among them, into every checkpoint (training_args.bin):
        # given relative to the run's folder, a run's files are the same wherever it is made (their sizes,
        # which the README's samples show, do not depend on the path of the folder it was made in)
        os.chdir(out)
        trainer = _hf_trainer(spec, Path("."), spec.steps)
        trainer.train()
        if spec.best_at:  # the weights training ended with (the best model's, loaded at the end)
            trainer.save_model(str(out / "final"))
        return

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


def _hf_trainer(spec: RunSpec, out: Path, max_steps: int, newer_saves: str = "refuse", callbacks=()):
    """The HF Trainer of an HF-layout run (its checkpoints in `out`, or `out/run` for a selective
    run, whose full reference saves go to `out/reference`)."""
    faults = [blow_up_callback(spec.blow_up, spec.blow_up_step)] if spec.blow_up else []
    trainer = make_trainer(spec, _trainer_args(spec, out / "run" if spec.selective else out, max_steps),
                           [*callbacks, *faults, *([_best_at(spec)] if spec.best_at else [])],
                           eval_dataset=trainer_dataset(spec)[:8] if spec.best_at else None)
    if spec.pinned:  # first: before the blow-up and the saves, and before the Trainer prints the log
        first_callback(trainer, pin_callback(spec.save_every, spec.blow_up_step if spec.blow_up else 0))
    if spec.selective:
        from tailor_tui.selective.hf import SelectiveCheckpointCallback

        trainer.add_callback(SelectiveCheckpointCallback(trainer, _strategy(spec), newer_saves=newer_saves))
        trainer.add_callback(_reference_saves(trainer, spec, out / "reference"))
        trainer.add_callback(_saves_seen(out / "on_save.txt"))
    return trainer


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
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    spawn_ranks(_train_rank, spec, str(out))
    (out / "tailor_demo_spec.json").write_text(spec.key() + "\n")
    return out


# --- resuming (used by the tests to prove that composed checkpoints load) ------------------


def _resume_rank(rank, world, port, spec: RunSpec, ckpt: str | Path, resave: str, result: str) -> None:
    """Load `ckpt` the way a user resumes, re-save the loaded state, train one step."""
    quiet()
    setup_rank(rank, world, port, spec)
    ckpt = Path(ckpt)
    losses: list[float] = []
    if spec.layout == "hf":
        from transformers import TrainerCallback

        class ResaveThenLog(TrainerCallback):
            def on_train_begin(self, args, state, control, **kw):
                # deepspeed_load_checkpoint has run by now: save exactly what was loaded.
                trainer.model_wrapped.save_checkpoint(resave, tag="resaved")

            def on_log(self, args, state, control, logs=None, **kw):
                if logs and "loss" in logs:
                    losses.append(float(logs["loss"]))

        step = json.loads((ckpt / TRAINER_STATE).read_text())["global_step"]
        trainer = make_trainer(spec, _trainer_args(spec, Path(resave) / "trainer-out", step + 1), [ResaveThenLog()])
        trainer.train(resume_from_checkpoint=str(ckpt))
    else:

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
        losses.append(float(loss))
    if rank == 0:
        Path(result).write_text(json.dumps({"losses": losses}))


def _continue_rank(rank, world, port, spec: RunSpec, out: str | Path, steps: int, resume: str, newer_saves: str,
                   resave: str | None, result: str) -> None:
    """Relaunch an HF selective run to `steps` in total, resuming as `resume` says."""
    quiet()
    setup_rank(rank, world, port, spec)
    from transformers import TrainerCallback

    from tailor_tui.selective.run_saves import resume_point

    out = Path(out)

    class ResaveAtBegin(TrainerCallback):
        def on_train_begin(self, args, state, control, **kw):  # the state as loaded
            trainer.model_wrapped.save_checkpoint(resave, tag="resaved")

    trainer = _hf_trainer(spec, out, steps, newer_saves, [ResaveAtBegin()] if resave else [])
    point = {"point": lambda: resume_point(out / "run"), "auto": lambda: True, "fresh": lambda: None}[resume]()
    trainer.train(resume_from_checkpoint=point)
    if rank == 0:
        Path(result).write_text(json.dumps({"resumed_from": point, "step": trainer.state.global_step}))


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


def resume_and_step(ckpt: str | Path, spec: RunSpec, resave: str | Path) -> list[float]:
    """Resume real DeepSpeed (HF Trainer for the HF layout) from `ckpt`.

    The state as loaded is re-saved under `resave/resaved`; returns the losses of the
    one training step that follows.
    """
    return resume_with(_resume_rank, ckpt, spec, resave)


def resume_with(resume_rank, ckpt: str | Path, spec: RunSpec, resave: str | Path) -> list[float]:
    """Run `resume_rank(rank, world, port, spec, ckpt, resave, result)` on every rank; rank 0
    writes {"losses": [...]} to `result` (in `resave`): those losses."""
    resave = Path(resave)
    resave.mkdir(parents=True, exist_ok=True)
    result = resave / "result.json"
    spawn_ranks(resume_rank, spec, str(ckpt), str(resave), str(result))
    return json.loads(result.read_text())["losses"]


def resume_demo(ckpt: Path) -> str:
    """Resume the composed checkpoint `ckpt` of a run made here (its folder's spec file says how it
    was trained) with real DeepSpeed and the HF Trainer on its ranks, for one more step: what happened,
    in a line (`make demo-resume`)."""
    import tempfile

    spec_file = ckpt.parent / "tailor_demo_spec.json"
    if not spec_file.is_file():
        raise SystemExit(f"error: {ckpt}: not beside a run made by tailor-tui --make-demo (no {spec_file.name})")
    spec = RunSpec.from_key(spec_file.read_text())
    state = json.loads((ckpt / TRAINER_STATE).read_text()) if spec.layout == "hf" else {}
    step = state.get("global_step", "?")
    with tempfile.TemporaryDirectory(prefix="tailor-resume-") as scratch:
        losses = resume_and_step(ckpt, spec, scratch)
    trainer = "the HF Trainer" if spec.layout == "hf" else "DeepSpeed"
    return (f"resumed {ckpt} (step {step}) with {trainer} on {spec.world_size} ranks: the next step trained, "
            f"loss {losses[0]:.4g}")


def main(argv: list[str] | None = None) -> None:
    """`python -m tailor_tui.runs.demo_run make OUT SPEC`, `resume CKPT SPEC RESAVE` (SPEC: a
    RunSpec.key()): how the tests make and resume runs under another DeepSpeed release;
    `resume-demo CKPT`: `make demo-resume`."""
    import sys

    args = sys.argv[1:] if argv is None else argv
    if len(args) == 3 and args[0] == "make":
        make_run(args[1], RunSpec.from_key(args[2]))
    elif len(args) == 4 and args[0] == "resume":
        print(json.dumps(resume_and_step(args[1], RunSpec.from_key(args[2]), args[3])))
    elif len(args) == 2 and args[0] == "resume-demo":
        print(resume_demo(Path(args[1])))
    else:
        raise SystemExit("usage: python -m tailor_tui.runs.demo_run make OUT SPEC | resume CKPT SPEC RESAVE | "
                         "resume-demo CKPT")


if __name__ == "__main__":
    main()
