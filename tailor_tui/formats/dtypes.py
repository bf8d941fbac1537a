"""Element types, named once: each dtype's names in torch's pickles, in safetensors headers and in
numpy, its size in bytes, and the training precisions. Torch-free.

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
