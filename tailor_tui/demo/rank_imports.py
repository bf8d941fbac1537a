"""What every rank of a run imports, and what takes most of a small run's time: imported once by the
server that ranks are forked from (`ranks.spawn_ranks`), not by each rank anew. Imported for that
alone; DS_ACCELERATOR is set by then (spawn_ranks)."""

import contextlib

import deepspeed  # noqa: F401
import torch.distributed  # noqa: F401
from transformers import Trainer, TrainingArguments  # noqa: F401

# DeepSpeed's optimizer check (`is_zero_supported_optimizer`, 0.18 on) imports its Muon optimizer, whose
# torch.compile decorator imports TorchInductor: 1.5 s of every rank's start; older releases have none
with contextlib.suppress(ImportError):
    import deepspeed.runtime.zero.muon.muon_optimizer  # noqa: F401
