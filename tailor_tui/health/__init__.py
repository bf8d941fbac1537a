"""Row health: statistics per rank and per run (`stats_job`, `stats_rank`, `stats_run`), the
healing rule and training logs (`healing`), and the NaN guard of `--apply` (`guard`).
"""
