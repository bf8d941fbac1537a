"""The demo run: a small but real DeepSpeed ZeRO-3 training run on a CPU-only machine.

`tailor-tui --make-demo` and `--demo` train it; `python -m tailor_tui.demo.demo_run resume-demo CKPT` (`make
demo-resume`) resumes a composition of it. A Llama trained by the HF Trainer under ZeRO-3 on 2 ranks, in bf16, with
checkpoints at steps 2, 4 and 6; layer 2 blows up just before the last save (`blowup`), so there is something to
heal; every save's values are pinned (`pinned`), so it shows the same numbers on every machine, those of the README.

Each rank is a process started with torch.multiprocessing (`ranks.spawn_ranks`: forked from a server that imported
torch, DeepSpeed and the Trainer once) on the gloo backend. Two settings keep this to seconds instead of minutes of
C++ op builds: a client `torch.optim.AdamW` (no `optimizer` block in the DeepSpeed config: the Trainer's) and the
shared-memory comm op disabled before init_distributed.

What is trained is a `DemoSpec`; its methods (the model, its data, the Trainer and its arguments, the DeepSpeed
config) are where a run of another kind differs: the tests' runs (tests/runs.py) are specs of their own built on
this one, trained and resumed by the same functions.
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from tailor_tui.demo.blowup import blow_up_callback
from tailor_tui.demo.pinned import first_callback, pin_callback
from tailor_tui.demo.ranks import quiet, setup_rank, spawn_ranks
from tailor_tui.kinds.folders import TRAINER_STATE

VOCAB = 101  # prime, so embedding and lm_head never split evenly across ranks
HEADS = 4
MAX_POSITIONS = 64
SPEC_FILE = "tailor_demo_spec.json"  # beside a run's checkpoints: how it was trained (its spec's key), written last


def llama_config(*, vocab: int, hidden: int, layers: int, intermediate: int | None = None, tied: bool = False):
    """A tiny Llama's transformers config (4 heads, 2 of keys and values; the MLP 1.5 x `hidden` by default)."""
    import transformers as tf

    return tf.LlamaConfig(vocab_size=vocab, tie_word_embeddings=tied, hidden_size=hidden,
                          intermediate_size=intermediate or hidden * 3 // 2, num_hidden_layers=layers,
                          num_attention_heads=HEADS, num_key_value_heads=2, max_position_embeddings=MAX_POSITIONS)


def token_rows(vocab: int, seed: int):
    """The training data's token ids: 256 rows of 8, drawn from `seed`."""
    import torch

    g = torch.Generator().manual_seed(1000 + seed)
    return torch.randint(0, vocab, (256, 8), generator=g)


@dataclass(frozen=True)
class DemoSpec:
    """What run to train: an HF Trainer run of a tiny Llama under ZeRO-3 (the demo's, `DEMO`)."""

    world_size: int = 2
    dtype: str = "bf16"  # "bf16" or "fp32"
    layers: int = 4
    hidden: int = 32
    steps: int = 6
    save_every: int = 2
    seed: int = 0
    vocab: int = VOCAB
    # make these parameters "blow up" just before the save at step `blow_up_step` (`blowup`): their fp32 master
    # weights and exp_avg_sq become NaN through DeepSpeed's own ZeRO-3 API; training goes on from there
    blow_up: tuple[str, ...] = ()
    blow_up_step: int = 0
    # just before every save, every parameter's weights and Adam moments, and the logged loss and grad norm, are
    # set to known values through DeepSpeed's own API (`pinned`): the numbers shown of the run are the same on
    # every CPU (the demo, the README's samples, the snapshot tests)
    pinned: bool = False

    def key(self) -> str:
        """A stable name for the run (`from_key` reads it back; `SPEC_FILE` holds it)."""
        return json.dumps(self.key_fields(), sort_keys=True)

    def key_fields(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_key(cls, text: str):
        fields: dict[str, Any] = {k: tuple(v) if isinstance(v, list) else v for k, v in json.loads(text).items()}
        return cls(**fields)

    def build_model(self):
        """The model trained, from its config with seeded random weights (nothing is downloaded)."""
        import torch
        import transformers as tf

        torch.manual_seed(self.seed)
        return tf.LlamaForCausalLM(llama_config(vocab=self.vocab, hidden=self.hidden, layers=self.layers))

    def dataset(self) -> list[dict]:
        """The Trainer's training rows: a causal LM predicts its tokens."""
        return [{"input_ids": row, "labels": row} for row in token_rows(self.vocab, self.seed)]

    def ds_config(self, for_trainer: bool = True) -> dict:
        """The DeepSpeed config: ZeRO-3, 16-bit weights gathered at each save; the batch the Trainer's (`auto`)."""
        return {
            "train_micro_batch_size_per_gpu": "auto" if for_trainer else 2,
            "gradient_accumulation_steps": "auto" if for_trainer else 1,
            "zero_optimization": {"stage": 3, "stage3_gather_16bit_weights_on_model_save": True},
            "bf16": {"enabled": self.dtype == "bf16"},
            "steps_per_print": 10**9,
        }

    def trainer_args(self, out: Path, max_steps: int, **more):
        """The Trainer's arguments: CPU, gloo, a save every `save_every` steps into `out`, a log line every step."""
        from transformers import TrainingArguments

        return TrainingArguments(
            **more,
            output_dir=str(out),
            per_device_train_batch_size=2,
            max_steps=max_steps,
            save_steps=self.save_every,
            save_strategy="steps",
            learning_rate=1e-3,
            weight_decay=0.1,
            bf16=self.dtype == "bf16",
            deepspeed=self.ds_config(for_trainer=True),
            report_to=[],
            logging_steps=1,
            ddp_backend="gloo",
            use_cpu=True,
            dataloader_num_workers=0,
            disable_tqdm=True,
            seed=self.seed,
            data_seed=self.seed,
        )

    def make_trainer(self, out: Path, max_steps: int, callbacks: list):
        """The HF Trainer of a run's training into `out` (a run of another kind may take options of its own)."""
        return self.resuming_trainer(self.trainer_args(out, max_steps), callbacks)

    def resuming_trainer(self, args, callbacks: list):
        """The HF Trainer, on a fresh model, that resumes a checkpoint with arguments `args`."""
        from transformers import Trainer

        return Trainer(model=self.build_model(), args=args, train_dataset=self.dataset(), callbacks=list(callbacks))

    def after_training(self, trainer, out: Path) -> None:
        """What a run of another kind does once its training ends (its Trainer's, in `out`)."""


# The demo run (`tailor-tui --demo`, `--make-demo`): HF Trainer, 2 ranks, bf16, checkpoints at steps 2, 4, 6;
# layer 2 blows up just before the last save, so there is something to heal. Pinned: it shows the same numbers on
# every machine, those of the README.
DEMO = DemoSpec(blow_up=("model.layers.2.mlp.down_proj.weight", "model.layers.2.self_attn.q_proj.weight"),
                blow_up_step=6, pinned=True)


def trainer(spec: DemoSpec, out: Path, max_steps: int, callbacks=(), **options):
    """The HF Trainer training `spec` into `out`, to `max_steps` steps in all: its layers blown up and its values
    pinned as `spec` says (`options`: `spec.make_trainer`'s)."""
    faults = [blow_up_callback(spec.blow_up, spec.blow_up_step)] if spec.blow_up else []
    made = spec.make_trainer(out, max_steps, [*callbacks, *faults], **options)
    if spec.pinned:  # first: before the blow-up and the saves, and before the Trainer prints the log
        first_callback(made, pin_callback(spec.save_every, spec.blow_up_step if spec.blow_up else 0))
    return made


def _train_rank(rank: int, world: int, port: int, spec: DemoSpec, out: str | Path) -> None:
    quiet()
    setup_rank(rank, world, port)
    out = Path(out).absolute()
    # The Trainer pickles its arguments, output_dir among them, into every checkpoint (training_args.bin): given
    # relative to the run's folder, a run's files are the same wherever it is made (their sizes, which the README's
    # samples show, do not depend on the path of the folder it was made in)
    os.chdir(out)
    made = trainer(spec, Path("."), spec.steps)
    made.train()
    spec.after_training(made, out)


def make_run(out: str | Path, spec: DemoSpec = DEMO, *, train_rank=None) -> Path:
    """Train `spec` with real DeepSpeed ZeRO-3 and the HF Trainer, leaving its checkpoints in `out` and its spec's
    key last (`SPEC_FILE`). `train_rank(rank, world, port, spec, out)`: what each rank runs, where a run of another
    layout trains otherwise (default: the HF Trainer's training)."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    spawn_ranks(train_rank or _train_rank, spec, str(out))
    (out / SPEC_FILE).write_text(spec.key() + "\n")
    return out


# --- resuming ------------------------------------------------------------------------------


def _resume_rank(rank, world, port, spec: DemoSpec, ckpt: str | Path, resave: str, result: str) -> None:
    """Load `ckpt` the way a user resumes (the HF Trainer's `resume_from_checkpoint`), save the state as loaded to
    `resave/resaved`, train one step; rank 0 writes its loss to `result`."""
    quiet()
    setup_rank(rank, world, port)
    from transformers import TrainerCallback

    ckpt = Path(ckpt)
    losses: list[float] = []

    class ResaveThenLog(TrainerCallback):
        def on_train_begin(self, args, state, control, **kw):
            # deepspeed_load_checkpoint has run by now: save exactly what was loaded.
            resuming.model_wrapped.save_checkpoint(resave, tag="resaved")

        def on_log(self, args, state, control, logs=None, **kw):
            if logs and "loss" in logs:
                losses.append(float(logs["loss"]))

    step = json.loads((ckpt / TRAINER_STATE).read_text())["global_step"]
    resuming = spec.resuming_trainer(spec.trainer_args(Path(resave) / "trainer-out", step + 1), [ResaveThenLog()])
    resuming.train(resume_from_checkpoint=str(ckpt))
    if rank == 0:
        Path(result).write_text(json.dumps({"losses": losses}))


def resume_with(resume_rank, ckpt: str | Path, spec: DemoSpec, resave: str | Path) -> list[float]:
    """Run `resume_rank(rank, world, port, spec, ckpt, resave, result)` on every rank; rank 0 writes {"losses":
    [...]} to `result` (in `resave`): those losses."""
    resave = Path(resave)
    resave.mkdir(parents=True, exist_ok=True)
    result = resave / "result.json"
    spawn_ranks(resume_rank, spec, str(ckpt), str(resave), str(result))
    return json.loads(result.read_text())["losses"]


def resume_and_step(ckpt: str | Path, spec: DemoSpec, resave: str | Path) -> list[float]:
    """Resume real DeepSpeed through the HF Trainer from `ckpt`: the state as loaded is re-saved under
    `resave/resaved`; the losses of the one training step that follows."""
    return resume_with(_resume_rank, ckpt, spec, resave)


def resume_demo(ckpt: Path) -> str:
    """Resume the composed checkpoint `ckpt` of the demo run (the spec file beside it says how it was trained) with
    real DeepSpeed and the HF Trainer on its ranks, for one more step: what happened, in a line."""
    import tempfile

    spec_file = ckpt.parent / SPEC_FILE
    if not spec_file.is_file():
        raise SystemExit(f"error: {ckpt}: not beside a run made by tailor-tui --make-demo (no {spec_file.name})")
    try:
        spec = DemoSpec.from_key(spec_file.read_text())
    except (ValueError, TypeError):
        raise SystemExit(f"error: {spec_file}: not the spec of a demo run; resume it as it was trained") from None
    step = json.loads((ckpt / TRAINER_STATE).read_text()).get("global_step", "?")
    with tempfile.TemporaryDirectory(prefix="tailor-resume-") as scratch:
        losses = resume_and_step(ckpt, spec, scratch)
    return (f"resumed {ckpt} (step {step}) with the HF Trainer on {spec.world_size} ranks: the next step trained, "
            f"loss {losses[0]:.4g}")


def main(argv: list[str] | None = None) -> None:
    """`python -m tailor_tui.demo.demo_run resume-demo CKPT`: `make demo-resume`."""
    import sys

    args = sys.argv[1:] if argv is None else argv
    if len(args) == 2 and args[0] == "resume-demo":
        print(resume_demo(Path(args[1])))
    else:
        raise SystemExit("usage: python -m tailor_tui.demo.demo_run resume-demo CKPT")


if __name__ == "__main__":
    main()
