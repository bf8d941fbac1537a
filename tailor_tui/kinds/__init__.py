"""The kinds of checkpoint, each an adapter: what it saved as a whole (`SaveKind`: which rows, where its
16-bit weights come from, its own records), its rank files (`RankFiles`: which file holds what) and their
reader (`RankReader`: where each byte lies, and the evidence it is checked against), its weights as the
source of an output's weight files (`WeightSource`: where each tensor lies), and the folder it lies in
(`FolderKind`: the HF Trainer's, Accelerate's or DeepSpeed's own layout). `base`: what every kind is asked,
and the helpers they share; `zero`: a full ZeRO-3 save; `partial`: a partial save of `selective` (its rows
file's recorded CRC-32s, its fp32 masters as weights); `hf_weights`: an HF save's own weight files;
`folders`: the training loops' layouts. Another kind is one more module.
"""

# its public API is its modules
__all__ = ["base", "folders", "hf_weights", "partial", "zero"]
