"""What every rank of a run imports, and what takes most of a small run's time: imported once by the
server that ranks are forked from (`ranks.spawn_ranks`), not by each rank anew. Imported for that
alone; DS_ACCELERATOR is set by then (spawn_ranks)."""

import deepspeed  # noqa: F401
import torch.distributed  # noqa: F401
from transformers import Trainer, TrainingArguments  # noqa: F401
