"""Checkpoints as found on disk: finding and describing them (`checkpoint`), where rows are found
(`rows`), the ZeRO-3 partition layout (`layout`), what each file of a checkpoint folder is
(`weight_files`, `model_layout`), and the cache outside every run (`cache`, `scan_cache`). Each rank's
files, as the kind of checkpoint that keeps them, are `tailor_tui.kinds`.
"""

# its public API is its modules
__all__ = ["cache", "checkpoint", "layout", "lineage", "model_layout", "model_states", "rows", "saved_names", "scan",
           "scan_cache", "side_files", "weight_files"]
