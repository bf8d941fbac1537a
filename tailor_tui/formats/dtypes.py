"""Element types, named once: each dtype's names in torch's pickles, in safetensors headers and in
numpy, its size in bytes, the training precisions, and the casts between the floating ones (`cast`, as
torch's `Tensor.to` makes them). Torch-free; numpy imported by the casts alone.

As the safetensors library keeps a single table of its dtypes, every module that needs an item
size or a name in another vocabulary looks it up here.
"""

from __future__ import annotations

from typing import NamedTuple


class DType(NamedTuple):
    name: str  # numpy / torch's name without the `torch.` prefix: float32, bfloat16, …
    storage: str  # the storage class torch pickles: FloatStorage, BFloat16Storage, …
    safetensors: str | None  # the name in a safetensors header: F32, BF16, … (None: no such dtype there)
    itemsize: int


TABLE = (
    DType("float64", "DoubleStorage", "F64", 8),
    DType("float32", "FloatStorage", "F32", 4),
    DType("float16", "HalfStorage", "F16", 2),
    DType("bfloat16", "BFloat16Storage", "BF16", 2),
    DType("int64", "LongStorage", "I64", 8),
    DType("int32", "IntStorage", "I32", 4),
    DType("int16", "ShortStorage", "I16", 2),
    DType("int8", "CharStorage", "I8", 1),
    DType("uint8", "ByteStorage", "U8", 1),
    DType("bool", "BoolStorage", "BOOL", 1),
    DType("complex64", "ComplexFloatStorage", None, 8),
    DType("complex128", "ComplexDoubleStorage", None, 16),
)
BY_NAME = {d.name: d for d in TABLE}
# a storage pickled without its element type (torch's UntypedStorage) holds bytes
STORAGE_ITEMSIZE = {d.storage: d.itemsize for d in TABLE} | {"UntypedStorage": 1}
STORAGE_DTYPE = {d.storage: d.name for d in TABLE} | {"UntypedStorage": "uint8"}
SAFETENSORS_ITEMSIZE = {d.safetensors: d.itemsize for d in TABLE if d.safetensors}
SAFETENSORS_NAME = {d.name: d.safetensors for d in TABLE if d.safetensors}  # float32 -> F32
# a run's training precision (bf16_ optim files, fp16 / fp32) -> its 16-bit (or fp32) weights' dtype
PRECISION = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}


def itemsize(name: str) -> int:
    """Bytes per element of a dtype by any of its names (float32, FloatStorage, F32)."""
    if name in BY_NAME:
        return BY_NAME[name].itemsize
    if name in STORAGE_ITEMSIZE:
        return STORAGE_ITEMSIZE[name]
    return SAFETENSORS_ITEMSIZE[name]


FLOATS = ("float32", "float16", "bfloat16")  # what `cast` casts between
_BY_SAFETENSORS = {d.safetensors: d.name for d in TABLE if d.safetensors}


def float_name(name: str) -> str:
    """float32, float16 or bfloat16 of a float dtype named either way (F32, BF16, …); any other name as it is."""
    return _BY_SAFETENSORS.get(name, name)


def cast(data, src: str, out: str) -> bytes:
    """Little-endian elements of float dtype `src` as `out` (by either name: float32 or F32), as torch's `Tensor.to`
    casts them: to bf16 and fp16 round to nearest even, overflow gives inf, bf16 to fp32 is exact; a NaN stays a
    NaN, bf16's as 0x7FC0 (torch's scalar cast; its vectorized kernels write 0xFFFF on some CPUs)."""
    import numpy as np

    src, out = float_name(src), float_name(out)
    if src == out:
        return bytes(data)
    values = np.frombuffer(data, dtype="<u2" if src == "bfloat16" else "<f2" if src == "float16" else "<f4")
    if src == "bfloat16":
        values = (values.astype(np.uint32) << 16).view(np.float32)
    elif src == "float16":
        values = values.astype(np.float32)
    if out == "float32":
        return values.astype("<f4").tobytes()
    if out == "float16":
        return values.astype("<f2").tobytes()
    bits = values.astype(np.float32).view(np.uint32)
    rounded = ((bits + np.uint32(0x7FFF) + ((bits >> 16) & np.uint32(1))) >> 16).astype(np.uint16)
    return np.where(np.isnan(values), np.uint16(0x7FC0), rounded).astype("<u2").tobytes()


def cast_difference(got, fp32, out: str) -> int | None:
    """The index of the first 16-bit element of `got` (dtype `out`: bf16 or fp16) that is not its float32 element
    of `fp32` cast (`cast`), a NaN matching any NaN (which NaN torch writes is its CPU kernel's); None: none."""
    import numpy as np

    out = float_name(out)
    mine = np.frombuffer(got, dtype="<u2")
    wrong = mine != np.frombuffer(cast(fp32, "float32", out), dtype="<u2")
    if not wrong.any():
        return None
    exponent, fraction = (0x7F80, 0x007F) if out == "bfloat16" else (0x7C00, 0x03FF)
    nan = ((mine & exponent) == exponent) & ((mine & fraction) != 0)
    wrong &= ~(nan & np.isnan(np.frombuffer(fp32, dtype="<f4")))
    found = np.flatnonzero(wrong)
    return int(found[0]) if found.size else None
