"""Composing for another world size: the output's partition by DeepSpeed's sub-group rule and
each output rank's pieces (`partition`), and the structure of the output rank files (`skeleton`).
"""

# its public API is its modules
__all__ = ["partition", "skeleton"]
