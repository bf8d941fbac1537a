"""Runs saved by Accelerate's `save_state` with the DeepSpeed plugin (ZeRO-3), and resuming them
with `load_state`: real Accelerate and DeepSpeed on CPU, ranks spawned as the demo run's are
(`tailor_tui.demo.ranks`).
Test code: the tests' fixture makes these runs (`conftest.real_run`); tailor-tui itself needs none of it.

`make_accelerate_run(out, spec)` trains `run_models.build_model(spec)` with an `Accelerator`
(`ProjectConfiguration(project_dir=out, automatic_checkpoint_naming=True)`), a client torch AdamW,
a torch LambdaLR scheduler and a DataLoader of random token rows; `accelerator.save_state()` every
`spec.save_every` steps writes `out/checkpoints/checkpoint_0`, `checkpoint_1`, ... (the layout
users get): DeepSpeed's checkpoint under the tag `pytorch_model` (with `latest`), and beside it
Accelerate's `scheduler.bin` and `random_states_<rank>.pkl`.

`resume_accelerate(ckpt, spec, resave)` loads a checkpoint with `accelerator.load_state(ckpt)`,
re-saves the loaded state to `resave/resaved` and trains one more step.

On CPU, Accelerate takes DeepSpeed only with ACCELERATE_USE_DEEPSPEED=true and a `PartialState`
created first on gloo (otherwise every process is process 0 of 1). transformers, torch and
accelerate are imported inside the functions.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from run_models import batch_inputs, build_model, param_groups
from runs import RunSpec

from tailor_tui.demo.demo_run import resume_with
from tailor_tui.demo.ranks import quiet, setup_rank, spawn_ranks

ROWS_PER_BATCH = 2  # ds_config's train_micro_batch_size_per_gpu
ROW_LEN = 8


def _accelerator(spec: RunSpec, project_dir: Path, automatic: bool):
    """The Accelerator of a run: DeepSpeed plugin with ZeRO-3 (the spec's `ds_config`), gloo on CPU."""
    if spec.dtype not in ("bf16", "fp32"):
        raise ValueError(f"Accelerate runs are bf16 or fp32, not {spec.dtype}")
    os.environ["ACCELERATE_USE_DEEPSPEED"] = "true"
    from accelerate import Accelerator, DeepSpeedPlugin, PartialState
    from accelerate.utils import DataLoaderConfiguration, ProjectConfiguration, set_seed

    PartialState(backend="gloo")
    set_seed(spec.seed)
    return Accelerator(
        deepspeed_plugin=DeepSpeedPlugin(hf_ds_config=spec.ds_config(for_trainer=False)),
        mixed_precision="bf16" if spec.dtype == "bf16" else "no",
        project_config=ProjectConfiguration(project_dir=str(project_dir), automatic_checkpoint_naming=automatic),
        dataloader_config=DataLoaderConfiguration(use_seedable_sampler=True),
    )


def _prepared(accelerator, spec: RunSpec):
    """Model, client AdamW, LambdaLR and a shuffled DataLoader, through `accelerator.prepare`."""
    import torch
    from torch.utils.data import DataLoader

    model = build_model(spec)
    opt = torch.optim.AdamW(param_groups(model), lr=1e-3)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda n: 1.0 / (1 + 0.1 * n))
    g = torch.Generator().manual_seed(2000 + spec.seed)
    rows = torch.randint(0, spec.vocab, (spec.steps * ROWS_PER_BATCH * spec.world_size, ROW_LEN), generator=g)
    # a list of rows is a map-style dataset (len, getitem); the stub asks for a Dataset
    loader: DataLoader[torch.Tensor] = DataLoader(list(rows), batch_size=ROWS_PER_BATCH,  # type: ignore[arg-type]
                                                  shuffle=True)
    return accelerator.prepare(model, opt, loader, sched)


def _step(accelerator, spec: RunSpec, model, opt, sched, ids) -> float:
    loss = model(**batch_inputs(spec, ids)).loss
    accelerator.backward(loss)  # DeepSpeed: engine.backward and engine.step
    opt.step()
    sched.step()
    opt.zero_grad()
    return float(loss)


def _train_rank(rank: int, world: int, port: int, spec: RunSpec, out: str) -> None:
    quiet()
    setup_rank(rank, world, port)
    accelerator = _accelerator(spec, Path(out), automatic=True)
    model, opt, loader, sched = _prepared(accelerator, spec)
    losses, step = [], 0
    while step < spec.steps:
        for ids in loader:
            step += 1
            losses.append(_step(accelerator, spec, model, opt, sched, ids))
            if step % spec.save_every == 0:
                accelerator.save_state()  # out/checkpoints/checkpoint_<n>
            if step == spec.steps:
                break
    if rank == 0:
        Path(out, "train_losses.json").write_text(json.dumps({"losses": losses}))


def make_accelerate_run(out: str | Path, spec: RunSpec = RunSpec(layers=3, steps=4, save_every=2)) -> Path:
    """Train `spec` with Accelerate + DeepSpeed ZeRO-3; checkpoints in `out/checkpoints/checkpoint_N`."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    spawn_ranks(_train_rank, spec, str(out))
    (out / "tailor_demo_spec.json").write_text(spec.key() + "\n")  # made: its last file, as make_run's
    return out


def _resume_rank(rank, world, port, spec: RunSpec, ckpt: str, resave: str, result: str) -> None:
    """Load `ckpt` with `load_state`, re-save what was loaded to `resave/resaved`, train one step."""
    quiet()
    setup_rank(rank, world, port)
    # no automatic naming: save_state would ignore its output_dir and write resave/checkpoints/...
    accelerator = _accelerator(spec, Path(resave), automatic=False)
    model, opt, loader, sched = _prepared(accelerator, spec)
    accelerator.load_state(ckpt)
    done = int(model.global_steps)  # DeepSpeed's step counter, from the checkpoint's model_states
    state = {"global_steps": done, "lr": sched.get_last_lr(), "accelerator_step": accelerator.step}
    accelerator.save_state(str(Path(resave, "resaved")))
    batches = list(loader)  # the epoch's order: the seedable sampler's, as in training
    losses = [_step(accelerator, spec, model, opt, sched, batches[done % len(batches)])]
    if rank == 0:
        Path(result).write_text(json.dumps({"losses": losses, "loaded": state}))


def resume_accelerate(ckpt: str | Path, spec: RunSpec, resave: str | Path) -> list[float]:
    """Resume an Accelerate run from its checkpoint folder `ckpt` (a `checkpoint_N`): the state as
    loaded is re-saved to `resave/resaved`; returns the losses of the one step that follows."""
    return resume_with(_resume_rank, ckpt, spec, resave)


def main(argv: list[str] | None = None) -> None:
    """`python tests/accelerate_run.py make OUT [SPEC]` or `resume CKPT SPEC RESAVE`."""
    import sys

    args = sys.argv[1:] if argv is None else argv
    default = RunSpec(layers=3, steps=4, save_every=2)
    if args[:1] == ["make"] and len(args) in (2, 3):
        make_accelerate_run(args[1], RunSpec.from_key(args[2]) if len(args) == 3 else default)
    elif args[:1] == ["resume"] and len(args) == 4:
        print(json.dumps(resume_accelerate(args[1], RunSpec.from_key(args[2]), args[3])))
    else:
        raise SystemExit("usage: python tests/accelerate_run.py make OUT [SPEC] | resume CKPT SPEC RESAVE")


if __name__ == "__main__":
    main()
