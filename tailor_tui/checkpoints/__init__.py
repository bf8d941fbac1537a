"""Checkpoints as found on disk: finding and describing them (`checkpoint`), where rows are found
(`rows`), the ZeRO-3 partition layout (`layout`), what each file of a checkpoint folder is
(`weight_files`, `model_layout`), a partial save's rows (`partial_rows`), and the cache outside
every run (`cache`, `scan_cache`).
"""

# its public API is its modules
__all__ = ["cache", "checkpoint", "layout", "lineage", "model_layout", "model_states", "partial_rows",
           "rank_reader", "rows", "saved_names", "scan", "scan_cache", "side_files", "weight_files"]
