"""Verifying a finished output (`--verify`), sharing no code with the writers that made it.

What the output must hold is worked out from what was asked (the plan: the recipe's picks, the
output's layout) and what exists (each checkpoint's layout, `checkpoints.open_checkpoint`), and
read with the formats' own reference readers: torch files by torch (`torch_files`: CRC-32s
checked first, weights-only, memory-mapped), safetensors files and a partial checkpoint's rows
files by the safetensors library (`rows_files`: recorded CRC-32s checked). The check of an
output against its recipe (`against_recipe`: `verify_against_recipe`, `VerifyReport`), of a resharded
output (`resharded`, where each of its elements comes from: `pieces`; its model_states files
unpickled once per content: `same_content`), of weight files (`weights`), comparing
loaded structures byte for byte (`compare`), and what the output's provenance record says was taken
against the output's own CRC-32s (`recorded`: what proves the rows of a source changed since). None of `compose/` nor the writers' readers
(`formats.ptfile`, `pickled`, `ptwrite`, `safetensors_in`, `safe_load`, `kinds`,
`resharding.partition`) is imported here (an import-linter contract says so); only the bounds
any checkpoint's pickle is held to (`formats.pickle_bounds`) guard torch's unpickling here too.
"""

# its public API is its modules
__all__ = ["against_recipe", "compare", "pieces", "recorded", "resharded", "rows_files", "same_content", "torch_files",
           "weights"]
