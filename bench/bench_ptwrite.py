"""Benchmark: the torch-free archive writer is linear in records.

For each count N, torch.save writes a structure of N one-element tensors (N + 6 records, the zip64
end records past 65,535 of them): that is the yardstick, measured in the same run. tailor-tui's
writer (`ptwrite.write_archive`) then writes the same archive again from that file, every storage
copied and its CRC-32 checked and set, and the two files are compared byte for byte. The records are
found with Python's own `zipfile` (tailor-tui's reader refuses more than 131,072 records, beyond any
checkpoint's; its writer is not bounded so). Printed: seconds, the ratio to torch.save, and
microseconds per record, which stay flat when the writer is linear.

    python bench/bench_ptwrite.py [--counts 10000 66000 200000]

Compare ratios between machines, not seconds.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from tailor_tui.formats.ptfile import Record  # noqa: E402
from tailor_tui.formats.ptwrite import Copied, write_archive  # noqa: E402


def copied_storages(path: Path) -> tuple[str, bytes, str, list[Copied]]:
    """(archive name, data.pkl, serialization id, every data/k as a Copied of the torch file's own record)."""
    with zipfile.ZipFile(path) as z, open(path, "rb") as f:
        infos = z.infolist()
        archive = infos[0].filename.split("/")[0]
        pickle = z.read(f"{archive}/data.pkl")
        storages = {}
        for info in infos:
            key = info.filename.removeprefix(f"{archive}/data/")
            if key == info.filename or not key.isdigit():
                continue
            f.seek(info.header_offset + 26)
            name_len, extra_len = int.from_bytes(f.read(2), "little"), int.from_bytes(f.read(2), "little")
            data_at = info.header_offset + 30 + name_len + extra_len
            record = Record(info.filename, info.header_offset, data_at, info.file_size, info.CRC, ())
            storages[int(key)] = Copied(path, record, data_at, info.file_size)
    ident = zipfile.ZipFile(path).read(f"{archive}/.data/serialization_id").decode()
    return archive, pickle, ident, [storages[k] for k in range(len(storages))]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--counts", type=int, nargs="+", default=[10_000, 66_000, 200_000])
    args = parser.parse_args()
    import torch

    print(f"{'records':>8}  {'torch.save':>10}  {'write_archive':>13}  {'ratio':>6}  {'µs/record':>9}  same bytes")
    with tempfile.TemporaryDirectory() as tmp:
        for n in args.counts:
            theirs, mine = Path(tmp) / f"t{n}.pt", Path(tmp) / f"m{n}.pt"
            obj = [torch.full((1,), float(i)) for i in range(n)]
            start = time.perf_counter()
            torch.save(obj, theirs)
            saved = time.perf_counter() - start
            archive, pickle, ident, storages = copied_storages(theirs)
            start = time.perf_counter()
            write_archive(mine, archive=archive, pickle=pickle, storages=storages, ident=ident)
            wrote = time.perf_counter() - start
            same = mine.read_bytes() == theirs.read_bytes()
            print(f"{n:>8,}  {saved:>9.2f}s  {wrote:>12.2f}s  {wrote / saved:>5.2f}x  {wrote / n * 1e6:>9.1f}  {same}",
                  flush=True)
            theirs.unlink()
            mine.unlink()


if __name__ == "__main__":
    main()
