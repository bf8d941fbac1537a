"""Reference point for the benchmark: the naive merge (what LLMTailor does).

Loads whole base and source rank files into memory with torch.load, replaces each
picked parameter's slices, torch.saves the result. Same partition math as DeepSpeed's
zero_to_fp32; used only for timing, never by tailor-tui.

    python bench/naive_merge.py BASE_TAG_DIR SOURCE_TAG_DIR OUT_TAG_DIR ROW [ROW ...]
"""

import math
import shutil
import sys
from pathlib import Path

import torch


def main(base: Path, source: Path, out: Path, rows: list[str]) -> None:
    out.mkdir(parents=True)
    for model_file in sorted(base.glob("*model_states.pt")):
        shutil.copyfile(model_file, out / model_file.name)
    states = torch.load(next(base.glob("*rank_0_*model_states.pt")), weights_only=False)
    world = states["dp_world_size"]
    picked = tuple(f"model.{r}." if not r.startswith("lm_head") else r for r in rows)
    for optim in sorted(base.glob("*optim_states.pt")):
        b = torch.load(optim, weights_only=False)
        s = torch.load(source / optim.name, weights_only=False)
        bi, si = b["optimizer_state_dict"], s["optimizer_state_dict"]
        for g, shapes in enumerate(states["param_shapes"]):
            offset = 0
            for name, shape in shapes.items():
                part = math.ceil(math.prod(shape) / world)
                if name.startswith(picked):
                    span = slice(offset, offset + part)
                    bi["fp32_flat_groups"][g].data[span] = si["fp32_flat_groups"][g].data[span]
                    for key in ("exp_avg", "exp_avg_sq"):
                        bi["optimizer_state_dict"]["state"][g][key][span] = si["optimizer_state_dict"]["state"][g][key][span]
                offset += part
        torch.save(b, out / optim.name)


if __name__ == "__main__":
    main(Path(sys.argv[1]), Path(sys.argv[2]), Path(sys.argv[3]), sys.argv[4:])
