"""The optimizers a demo run (`demo_run`, DeepSpeed layout) trains with, by name (`RunSpec.optimizer`): torch's
AdamW, SGD with momentum, Adagrad and RMSprop with momentum, transformers' Adafactor (unfactored on ZeRO-3's
1-D flat partitions) and a small Lion (`Lion`: DeepSpeed's FusedLion has no CPU kernel). Each keeps its own
state per element of the flat partitions (AdamW's exp_avg and exp_avg_sq, SGD's momentum_buffer, Adagrad's sum,
RMSprop's square_avg and momentum_buffer, Adafactor's exp_avg_sq, Lion's exp_avg), which tailor-tui composes per
row as it does the fp32 masters (`ds_format.state_keys`).
"""

from __future__ import annotations

NAMES = ("adamw", "sgd", "adagrad", "rmsprop", "adafactor", "lion")


def make_optimizer(name: str, groups, *, amsgrad: bool = False):
    """The torch optimizer `name` (one of NAMES) over parameter groups `groups` (`amsgrad`: AdamW's)."""
    import torch

    if name == "adamw":
        return torch.optim.AdamW(groups, lr=1e-3, amsgrad=amsgrad)
    if name == "sgd":
        return torch.optim.SGD(groups, lr=1e-3, momentum=0.9)
    if name == "adagrad":
        # ZeRO-3 builds Adagrad again over every flat partition in one parameter group (its state is made at
        # construction), then steps each sub-group as its group's: more than one group fails its first step
        # (DeepSpeed 0.19: an IndexError in `_optimizer_step`), as the HF Trainer's `adagrad`, which splits
        # decay from no decay, does. One group: no weight decay.
        return torch.optim.Adagrad([{"params": [p for group in groups for p in group["params"]]}], lr=1e-2)
    if name == "rmsprop":
        return torch.optim.RMSprop(groups, lr=1e-3, momentum=0.9)
    if name == "adafactor":
        from transformers.optimization import Adafactor

        return Adafactor(groups, lr=1e-3, scale_parameter=False, relative_step=False, warmup_init=False)
    if name == "lion":
        return _lion(groups)
    raise ValueError(f"optimizer {name!r}: not one of {', '.join(NAMES)}")


def _lion(groups):
    import torch

    class Lion(torch.optim.Optimizer):
        """Lion (Chen et al., 2023, "Symbolic Discovery of Optimization Algorithms"): the sign of an
        interpolation of the momentum and the gradient; one state per element, `exp_avg`."""

        def __init__(self, params, lr: float = 1e-4, betas: tuple[float, float] = (0.9, 0.99),
                     weight_decay: float = 0.0):
            super().__init__(params, dict(lr=lr, betas=betas, weight_decay=weight_decay))

        @torch.no_grad()
        def step(self, closure=None):
            loss = None
            if closure is not None:
                with torch.enable_grad():
                    loss = closure()
            for group in self.param_groups:
                beta1, beta2 = group["betas"]
                for p in group["params"]:
                    if p.grad is None:
                        continue
                    state = self.state[p]
                    if not state:
                        state["exp_avg"] = torch.zeros_like(p)
                    exp_avg = state["exp_avg"]
                    p.mul_(1 - group["lr"] * group["weight_decay"])
                    p.add_(exp_avg.mul(beta1).add(p.grad, alpha=1 - beta1).sign_(), alpha=-group["lr"])
                    exp_avg.mul_(beta2).add_(p.grad, alpha=1 - beta2)
            return loss

    return Lion(groups, lr=1e-4)
