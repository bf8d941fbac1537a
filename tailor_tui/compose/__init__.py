"""Composing: the composer's picks (`composition`), the compose step as a whole (`folder`), the
writers of rank files (`rank_task`, `rank_stream`, `rank_partial`, `rank_torch`, `rank_reshard`) and
of weight files (`model_files`, `bin_files`). The independent check of an output is
`tailor_tui.verifying`; `verify`, `verify_reshard` and `compare` here are its old paths, kept
with a DeprecationWarning.
"""
