"""Composing: the compose step as a whole (`compose_run`), the
writers of rank files (`rank_task`, `rank_stream`, `rank_partial`, `rank_torch`, `rank_reshard`) and
of weight files (`model_files`, `bin_files`), and what they report they took (`taken`). The
independent check of an output is `tailor_tui.verifying`.
"""

# its public API is its modules
__all__ = ["bin_files", "compose_run", "model_files", "rank_partial", "rank_reshard", "rank_stream",
           "rank_task", "rank_torch", "taken"]
