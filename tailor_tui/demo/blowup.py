"""A layer that "blows up" in a real run: its parameters' fp32 master weights become NaN and
their exp_avg_sq +Inf, set through DeepSpeed's own ZeRO-3 API (safe_set_full_fp32_param /
safe_set_full_optimizer_state) just before a save, as a diverged layer leaves them. The demo
run has one (so the heatmap, the NaN guard and healing have something to show); the tests
of row health use it too.
"""

from __future__ import annotations


def blow_up(module, names: tuple[str, ...]) -> None:
    """Set the parameters `names` of a ZeRO-3 `module` to NaN (exp_avg_sq to +Inf), on every
    rank (collective: every rank calls it). A frozen parameter has neither an fp32 master nor
    moments: its own values become NaN (gathered, set on rank 0, re-partitioned by DeepSpeed)."""
    import deepspeed
    import torch
    from deepspeed.utils import safe_set_full_fp32_param, safe_set_full_optimizer_state

    for name, param in module.named_parameters():
        if name not in names:
            continue
        if not param.requires_grad:
            with deepspeed.zero.GatheredParameters([param], modifier_rank=0):
                if torch.distributed.get_rank() == 0:
                    param.data.fill_(float("nan"))
            continue
        safe_set_full_fp32_param(param, torch.full(param.ds_shape, float("nan")))
        safe_set_full_optimizer_state(param, torch.full(param.ds_shape, float("inf")), "exp_avg_sq")


def blow_up_callback(names: tuple[str, ...], step: int):
    """An HF Trainer callback that blows `names` up at the end of `step`, before that step's save."""
    from transformers import TrainerCallback

    class BlowUp(TrainerCallback):
        def on_step_end(self, args, state, control, model=None, **kw):
            if state.global_step == step:
                blow_up(model, names)

    return BlowUp()
