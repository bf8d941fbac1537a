"""tailor-tui: compose DeepSpeed ZeRO-3 checkpoints layer by layer."""

__version__ = "0.1.0"
