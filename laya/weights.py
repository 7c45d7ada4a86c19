"""`model.safetensors` without torch: where each tensor's bytes are, and memory-mapped numpy views.

safetensors' own numpy API copies every tensor into a fresh array. This reader maps the file and
hands out views (what int8 quantisation reads), and byte spans (`span`), which the ONNX graph gives
onnxruntime as external data so that it reads the weights from the checkpoint file itself. The format
is a little-endian u64 header size, a JSON header `{name: {dtype, shape, data_offsets}}`, then the bytes.
"""

from __future__ import annotations

import json
import mmap
import os
from collections.abc import Iterator

import numpy as np

_DTYPES = {"F32": np.float32, "F16": np.float16, "BF16": np.uint16, "F64": np.float64, "I64": np.int64,
           "I32": np.int32, "I16": np.int16, "I8": np.int8, "U8": np.uint8, "BOOL": np.bool_}


class SafeTensors:
    """Read-only views of the tensors of one file; `float32(name)` converts where needed."""

    def __init__(self, path: str | os.PathLike):
        self.path = str(path)
        with open(self.path, "rb") as f:
            file_size = os.fstat(f.fileno()).st_size
            size = int.from_bytes(f.read(8), "little")
            if not 0 < size <= file_size - 8:
                raise ValueError(f"{self.path}: not a safetensors file (its header size {size} does not fit in "
                                 f"its {file_size} bytes)")
            try:
                header = json.loads(f.read(size))
            except (UnicodeDecodeError, json.JSONDecodeError) as exc:
                raise ValueError(f"{self.path}: not a safetensors file (its header is not JSON: {exc})") from None
            self._map = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        header.pop("__metadata__", None)
        self._base = 8 + size
        self.entries: dict[str, dict] = header
        for name, e in header.items():
            if e["dtype"] not in _DTYPES:
                raise ValueError(f"{self.path}: tensor {name} has dtype {e['dtype']}, which laya does not read")
            # a cut or damaged file: refuse it here, naming it, not when onnxruntime or numpy reads past its end
            if self._base + e["data_offsets"][1] > file_size:
                raise ValueError(f"{self.path}: tensor {name} ends at byte {self._base + e['data_offsets'][1]}, past "
                                 f"the file's {file_size} bytes (a truncated or damaged file)")

    def __contains__(self, name: str) -> bool:
        return name in self.entries

    def __iter__(self) -> Iterator[str]:
        return iter(self.entries)

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self.entries[name]["shape"])

    def dtype(self, name: str) -> str:
        return self.entries[name]["dtype"]

    def span(self, name: str, rows: slice | None = None) -> tuple[int, int, tuple[int, ...]]:
        """(byte offset in the file, byte length, shape) of a tensor or of a range of its first axis."""
        if name not in self.entries:
            raise KeyError(f"{self.path} has no tensor {name!r}")
        e = self.entries[name]
        shape = list(e["shape"])
        start, end = e["data_offsets"]
        if rows is not None:
            lo, hi, step = rows.indices(shape[0])
            if step != 1:
                raise ValueError("span: row ranges only")
            row_bytes = (end - start) // shape[0]
            start, end, shape[0] = start + lo * row_bytes, start + hi * row_bytes, hi - lo
        return self._base + start, end - start, tuple(shape)

    def raw(self, name: str) -> np.ndarray:
        """The stored bytes as an array of the stored type (BF16 as uint16), a view of the mapping."""
        if name not in self.entries:
            raise KeyError(f"{self.path} has no tensor {name!r}")
        e = self.entries[name]
        start, end = e["data_offsets"]
        dtype = np.dtype(_DTYPES[e["dtype"]])
        count = (end - start) // dtype.itemsize
        return np.frombuffer(self._map, dtype, count, self._base + start).reshape(e["shape"])

    def float32(self, name: str) -> np.ndarray:
        """As float32: a view when stored so, else a converted copy (F16 and BF16 widen exactly)."""
        a = self.raw(name)
        if self.dtype(name) == "BF16":
            return (a.astype(np.uint32) << 16).view(np.float32)
        return a if a.dtype == np.float32 else a.astype(np.float32)

    def release(self) -> None:
        """Drop the mapped pages from this process's memory (they are re-read from the file if touched)."""
        if hasattr(mmap, "MADV_DONTNEED"):
            self._map.madvise(mmap.MADV_DONTNEED)
