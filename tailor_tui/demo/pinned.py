"""Known values at every save of a run, so that what is shown of it is the same on every CPU.

Training in float32/bf16 on a CPU is not bit-reproducible across machines: vector kernels round
differently (torch's AVX2 and default kernels give different matmul sums on one machine, and a run's
weights, moments and losses differ in their last digits from machine to machine). A run whose spec
says `pinned` trains for real, and just before each save every parameter is set to values that
depend only on its name, its size and the step, through DeepSpeed's own ZeRO-3 API, as the demo's
blow-up is (`blowup`): its 16-bit weights (gathered, set on rank 0, re-partitioned by DeepSpeed),
its fp32 master weights and Adam moments (`safe_set_local_fp32_param`,
`safe_set_local_optimizer_state`). The loss and grad norm the HF Trainer logs are set likewise. The
checkpoints' layout, files and every tensor's bytes are DeepSpeed's and the Trainer's; only the
numbers are chosen: the demo (`make demo`), the README's samples and the test-suite's snapshots show
the same figures on any machine.

The values are small whole numbers times a power of two (|k| <= 16), so that every sum tailor-tui
forms of them (squares and differences over 1024-element float32 blocks, then float64) is exact:
no summation order, SIMD width or BLAS kernel changes a digit. Between two saves a share of each
parameter's elements (one in P, P chosen by name) moves by a unit, so rows change at different rates.
A frozen parameter never changes: its values do not depend on the step.
"""

from __future__ import annotations

import zlib

_PERIODS = (10, 40, 160, 640)  # one element in P moves between saves: a Δ of about 4%, 2%, 1%, 0.5%


def _whole(name: str, numel: int, step: int, salt: int = 0):
    """Whole numbers in [-16, 16], one per element, from the parameter's name, the step and `salt`:
    each in [-15, 15], and one element in P of them nudged by -1, 0 or +1 by the step."""
    import torch

    seed = zlib.crc32(f"{name}/{salt}".encode())
    i = torch.arange(numel, dtype=torch.int64)
    period = _PERIODS[seed % len(_PERIODS)]
    moved = ((i % period) == (seed % period)).to(torch.int64)
    nudge = (((i * 40503 + step * 2246822519 + seed) >> 5) % 3) - 1
    return ((i * 2654435761 + seed) >> 7) % 31 - 15 + moved * nudge


def weights(name: str, shape, step: int):
    """A parameter's values at `step` (float32): norms' weights around 1 ((64 + k) / 64), every other
    parameter k / 128 (an RMS of about 0.07)."""
    import math

    import torch

    k = _whole(name, math.prod(shape), step).to(torch.float32)
    values = (64 + k) / 64 if name.endswith("norm.weight") else k / 128
    return values.reshape(tuple(shape))


def moments(name: str, shape, step: int):
    """(exp_avg, exp_avg_sq) of a parameter at `step` (float32): k / 2^14 and (k^2 + 1) / 2^(26 + 0..3)."""
    import math

    import torch

    numel = math.prod(shape)
    m = _whole(name, numel, step, salt=1).to(torch.float32) / 2**14
    scale = 2.0 ** -(26 + zlib.crc32(name.encode()) % 4)
    v = (_whole(name, numel, step, salt=2).to(torch.float32) ** 2 + 1) * scale
    return m.reshape(tuple(shape)), v.reshape(tuple(shape))


def log_values(step: int, spike_at: int = 0) -> dict:
    """The loss and grad norm logged at `step`, exact in binary: a gentle decline; where the run blows up at step
    `spike_at` (0: never), the loss spike it tells of: from the step before it on, the loss jumps (by 1/2, then by
    3/2) and the grad norm with it (4, then 12), as a diverging run's log shows."""
    if spike_at and step >= spike_at - 1:
        jumped = step >= spike_at
        return {"loss": (1190 - step + (384 if jumped else 128)) / 256, "grad_norm": 12.0 if jumped else 4.0}
    return {"loss": (1190 - step) / 256, "grad_norm": (48 + step) / 64}


def pin(module, step: int) -> None:
    """Set every parameter of the ZeRO-3 `module` to its values at `step` (collective: every rank calls
    it): the 16-bit weights, and for a trained parameter its fp32 master weights and Adam moments.
    Each rank sets its own partition (`safe_set_local_*`): DeepSpeed's `safe_set_full_*` slices the
    full value without the padding of the last rank, and fails on a parameter whose size the world
    size does not divide (a 3-rank run's 101-row embedding)."""
    import deepspeed
    import torch
    from deepspeed.utils import safe_set_local_fp32_param, safe_set_local_optimizer_state

    params = list(module.named_parameters())
    with deepspeed.zero.GatheredParameters([p for _, p in params], modifier_rank=0):
        if torch.distributed.get_rank() == 0:
            for name, param in params:
                param.data.copy_(weights(name, param.shape, step if param.requires_grad else 0))
    for name, param in params:
        if not param.requires_grad:
            continue
        safe_set_local_fp32_param(param, _partition(param, weights(name, param.ds_shape, step)))
        exp_avg, exp_avg_sq = moments(name, param.ds_shape, step)
        safe_set_local_optimizer_state(param, _partition(param, exp_avg), "exp_avg")
        safe_set_local_optimizer_state(param, _partition(param, exp_avg_sq), "exp_avg_sq")


def _partition(param, full):
    """This rank's partition of `full`, the values of the ZeRO-3 parameter `param`: equal slices, the
    last one padded with zeros."""
    import torch

    size, rank = param.ds_tensor.numel(), torch.distributed.get_rank()
    padded = torch.zeros(size * torch.distributed.get_world_size(), dtype=torch.float32)
    padded[: full.numel()] = full.flatten()
    return padded.narrow(0, size * rank, size)


def pin_callback(save_every: int, spike_at: int = 0):
    """An HF Trainer callback: `pin` at the end of every step that saves (before the save and before
    the other callbacks of that step, such as a blow-up), and the logged loss and grad norm set to
    `log_values` as they are logged (`spike_at`: the step the run blows up at), in the log history and in
    what the Trainer prints (so it must come before the Trainer's own callbacks: `first_callback`)."""
    from transformers import TrainerCallback

    class Pin(TrainerCallback):
        def on_step_end(self, args, state, control, model=None, **kw):
            if state.global_step % save_every == 0:
                pin(model, state.global_step)

        def on_log(self, args, state, control, logs=None, **kw):
            entry = state.log_history[-1] if state.log_history else {}
            if "train_loss" in entry:  # the run's mean loss, as the Trainer reports it at its end
                steps = range(1, state.global_step + 1)
                values = {"train_loss": sum(log_values(s, spike_at)["loss"] for s in steps) / len(steps)}
            elif "loss" in entry:
                values = log_values(state.global_step, spike_at)
            else:
                return
            entry.update(values)
            if logs is not None:
                logs.update(values)  # what the Trainer's printer shows

    return Pin()


def first_callback(trainer, callback) -> None:
    """Add `callback` to `trainer` ahead of its own (the printer and progress bars), so that what it sets in a log
    entry is what they show."""
    trainer.callback_handler.callbacks.insert(0, callback)
