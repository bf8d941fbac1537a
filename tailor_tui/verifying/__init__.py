"""Verifying a finished output (`--verify`), sharing no code with the writers that made it.

What the output must hold is worked out from what was asked (the plan: the recipe's picks, the
output's layout) and what exists (each checkpoint's layout, `checkpoints.open_checkpoint`): where each
row's bytes lie in the output and in its source, rank by rank (`zero_ranks`: at the base's world size;
`resharded`: at another, each element's place worked out anew: `pieces`), and each weight file's tensors
(`weights`). Each is a claim on a range of the output's bytes (`rank_claims`), and the claims are run
streamed (`streamed`): every file read once, in chunks, by threads in parallel, each byte compared with its
source's where it is read and every record checked against its stored CRC-32 on the way (a partial save's
slices against the CRC-32s their save recorded), in bounded memory, without torch. Files are read as every
part reads them: the checked read path (`checked`, `buffers`) and the torch-free readers of where a file's
tensors lie (`formats.ptfile`, `formats.safetensors_in`, `dcp.reading`); none of `compose/` nor the kinds' readers
(`kinds`, `resharding`) is imported here (an import-linter contract says so). The check of an output against
its recipe (`against_recipe`: `verify_against_recipe`, `VerifyReport`), what the output's provenance record
says was taken against the output's own CRC-32s (`recorded`: what proves the rows of a source changed since),
comparing structures (`compare`), a DCP composition (`dcp_output`: archives record for record, a ZeRO-3 row's
chunks element for element); a model file's tensor cast from a partial save's or a DCP checkpoint's fp32 master is
claimed on the master's bytes, cast as they are read, and a frozen parameter or a buffer on what the partial's
model_states keep of it (`weights`, `dcp_sources`). Only a tensor no claim can place is still loaded by torch
(`torch_files`, `rows_files`), one at a time; `same_content` (torch files unpickled once per content) is kept for
its callers.
"""

# its public API is its modules
__all__ = ["against_recipe", "buffers", "compare", "dcp_output", "pieces", "rank_claims", "recorded", "resharded",
           "rows_files", "same_content", "streamed", "torch_files", "weights", "zero_ranks"]
