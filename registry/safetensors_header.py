"""Reading a safetensors header defensively, before any library touches the file.

Layout: u64 little-endian N | N bytes of JSON {tensor: {dtype, shape, data_offsets: [begin, end]}, "__metadata__": {..}}
| data. A hostile N (e.g. 2**63) must be refused before allocating N bytes.
"""

from __future__ import annotations

import json
import math
import struct
from pathlib import Path

from pydantic import BaseModel

from registry.errors import RegistryValidationError

__all__ = ["TensorInfo", "read_header", "DTYPE_SIZES"]

DTYPE_SIZES = {"F64": 8, "F32": 4, "F16": 2, "BF16": 2, "I64": 8, "I32": 4, "I16": 2, "I8": 1, "U8": 1, "BOOL": 1,
               "F8_E4M3": 1, "F8_E5M2": 1}


class TensorInfo(BaseModel):
    dtype: str
    shape: list[int]
    begin: int
    end: int


def _bad(path: Path, why: str) -> RegistryValidationError:
    return RegistryValidationError(f"malformed safetensors header in {path.name}: {why}", code="bad_safetensors")


def read_header(path: Path, max_header_bytes: int) -> dict[str, TensorInfo]:
    """-> tensor name -> TensorInfo; raises RegistryValidationError(code="bad_safetensors")."""
    size = path.stat().st_size
    with path.open("rb") as f:
        prefix = f.read(8)
        if len(prefix) < 8:
            raise _bad(path, f"file is {size} bytes, shorter than the 8-byte header length")
        (n,) = struct.unpack("<Q", prefix)
        if n > max_header_bytes or n > size - 8:
            raise _bad(path, f"header length {n} exceeds the limit ({min(max_header_bytes, size - 8)} bytes)")
        raw = f.read(n)
    try:
        header = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, ValueError) as e:
        raise _bad(path, f"header is not valid JSON ({e})") from e
    if not isinstance(header, dict):
        raise _bad(path, "header is not a JSON object")
    data_len = size - 8 - n
    tensors: dict[str, TensorInfo] = {}
    for name, entry in header.items():
        if name == "__metadata__":
            # The format allows a flat string -> string map only; safetensors refuses anything else on load.
            if not (isinstance(entry, dict) and all(isinstance(v, str) for v in entry.values())):
                raise _bad(path, "__metadata__ must map strings to strings (nested values are not allowed)")
            continue
        tensors[name] = _parse_entry(path, name, entry, data_len)
    _check_layout(path, tensors, data_len)
    return tensors


def _parse_entry(path: Path, name: str, entry: object, data_len: int) -> TensorInfo:
    if not isinstance(entry, dict):
        raise _bad(path, f"entry for {name!r} is not an object")
    dtype, shape, offsets = entry.get("dtype"), entry.get("shape"), entry.get("data_offsets")
    if dtype not in DTYPE_SIZES:
        raise _bad(path, f"tensor {name!r} has unknown dtype {dtype!r}")
    if not (isinstance(shape, list) and all(isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in shape)):
        raise _bad(path, f"tensor {name!r} has invalid shape {shape!r}")
    if not (isinstance(offsets, list) and len(offsets) == 2
            and all(isinstance(o, int) and not isinstance(o, bool) for o in offsets)
            and 0 <= offsets[0] <= offsets[1] <= data_len):
        raise _bad(path, f"tensor {name!r} has data_offsets {offsets!r} outside the {data_len}-byte data section")
    if offsets[1] - offsets[0] != math.prod(shape) * DTYPE_SIZES[dtype]:
        raise _bad(path, f"tensor {name!r}: byte range does not match shape {shape} x {dtype}")
    return TensorInfo(dtype=dtype, shape=shape, begin=offsets[0], end=offsets[1])


def _check_layout(path: Path, tensors: dict[str, TensorInfo], data_len: int) -> None:
    # The tensors must tile the data section exactly, as safetensors' own loader demands: overlaps would let two
    # tensors alias the same bytes, gaps and trailing bytes hide data no tensor accounts for.
    spans = sorted((t.begin, t.end, n) for n, t in tensors.items())
    end, prev = 0, None
    for b, e, n in spans:
        if b < end:
            raise _bad(path, f"tensors {prev!r} and {n!r} overlap")
        if b > end:
            raise _bad(path, f"gap in data_offsets: bytes {end}-{b} before tensor {n!r} belong to no tensor")
        end, prev = e, n
    if end != data_len:
        raise _bad(path, f"gap in data_offsets: {data_len - end} trailing bytes after the last tensor belong to "
                         f"no tensor")
