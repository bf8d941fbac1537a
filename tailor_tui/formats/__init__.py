"""File formats, read and written without torch: torch's zip and legacy archives and their pickles
(`ptfile`, its zip directory `zipdir`, `ptlegacy`, `pickled`, `ptpickle`, `ptwrite`), safetensors (`safetensors_in`,
`safetensors_out`), DeepSpeed's vocabulary (`ds_format`), element types (`dtypes`), non-finite
counting (`nonfinite`), and the one place torch loads a file (`safe_load`).
"""

# its public API is its modules
__all__ = ["ds_format", "dtypes", "nonfinite", "pickle_bounds", "pickled", "ptfile", "ptlegacy", "ptpickle",
           "ptwrite", "safe_load", "safetensors_in", "safetensors_out", "side_globals", "side_pickles", "zipdir"]
