"""The packed bf16 engine's work between its GEMMs as compiled kernels (`kernels.c`): rotary plus per-row
attention, the residual add fused into the next layer norm, a layer norm to bf16, and the output layers' small
per-row fp32 linears.

Why kernels of our own: at 2 threads on an Intel AMX CPU (docs/benchmarks.md, Dec 4) the packed engine's GEMMs
took ~36 of a 66 ms predict and the torch ops between them most of the rest: ~900 small calls per predict (per
row and layer two `bmm`, a softmax, copies; casts, mixed-type adds, norms), each refilling the core's L2 after a
GEMM and each paying dispatch. torch.compile's guards cost more than these ops at these sizes, SDPA runs per row
too and slower, and no CPU library does rotary plus attention over packed rows of different lengths with a row's
bits kept independent of its batch mates. The attention kernel reads the Wqkv GEMM's bf16 output directly and
writes the bf16 input of the Wo GEMM, so the fp32 widening of q|k|v, the rotated copies and the fp32 attention
output are never materialised; the fused add + norm writes the residual stream (with `torch.add`'s bits) and the
next GEMM's bf16 input in one pass.

They are compiled at first use with the system's C compiler (`cc`, ~0.3 s; `-march=native`, so the build is
keyed by this CPU's flags and the source) into `$XDG_CACHE_HOME/pagoda/kernels/`, and share torch's OpenMP
runtime (the library asks for `libgomp.so.1`, which torch has loaded already), so their threads are torch's.
Without a compiler, or with `PAGODA_KERNELS=0`, `available()` is False (`unavailable_reason()` says why) and
the engine keeps its torch ops: answers then differ in their last bits from the kernels' (both ways
deterministic and batch-mate independent)."""

from __future__ import annotations

import ctypes
import hashlib
import os
import shutil
import subprocess
import tempfile
import warnings
from functools import lru_cache
from pathlib import Path

import torch

SOURCE = Path(__file__).with_name("kernels.c")
FLAGS = ["-O3", "-march=native", "-fopenmp", "-shared", "-fPIC"]
ENV = "PAGODA_KERNELS"


def _cpu_flags() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(("flags", "Features")):
                return line
    except OSError:
        pass
    return os.uname().machine


def _library_path() -> Path:
    key = hashlib.sha256(SOURCE.read_bytes() + " ".join(FLAGS).encode() + _cpu_flags().encode()).hexdigest()[:16]
    cache = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "pagoda" / "kernels"
    return cache / f"kernels-{key}.so"


def build() -> Path:
    """Compile the kernel for this CPU unless built already; returns the library's path. Raises OSError or
    CalledProcessError when it cannot (no compiler, no OpenMP, unwritable cache)."""
    target = _library_path()
    if target.exists():
        return target
    compiler = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if compiler is None:
        raise OSError("no C compiler (cc or gcc) on PATH")
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
        built = Path(tmp) / target.name
        subprocess.run([compiler, *FLAGS, str(SOURCE), "-o", str(built), "-lm"], check=True, capture_output=True)
        os.replace(built, target)           # atomic: concurrent builders never load a half-written file
    return target


_unavailable: list[str] = []       # why `_library()` found none, once it has looked


@lru_cache(maxsize=1)
def _library() -> ctypes.CDLL | None:
    _unavailable.clear()
    if os.environ.get(ENV, "1") == "0":
        _unavailable.append(f"switched off ({ENV}=0)")
        return None
    try:
        lib = ctypes.CDLL(str(build()))
    except (OSError, subprocess.CalledProcessError) as exc:
        detail = exc.stderr.decode(errors="replace").strip() if isinstance(exc, subprocess.CalledProcessError) else exc
        _unavailable.append(f"not built: {detail}")
        warnings.warn(f"laya.kernels {_unavailable[0]}; the bf16 engine runs its torch ops instead", RuntimeWarning,
                      stacklevel=2)
        return None
    lib.pagoda_attention.restype = ctypes.c_int
    lib.pagoda_attention.argtypes = [ctypes.c_void_p, ctypes.c_long, ctypes.c_void_p, ctypes.c_int, ctypes.c_void_p,
                                     ctypes.c_long, ctypes.c_void_p, ctypes.c_int, ctypes.c_int, ctypes.c_int,
                                     ctypes.c_void_p, ctypes.c_int, ctypes.c_void_p, ctypes.c_int]
    lib.pagoda_add_widened.restype = None
    lib.pagoda_add_widened.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_long, ctypes.c_int]
    lib.pagoda_rows_linear.restype = None
    lib.pagoda_rows_linear.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int, ctypes.c_int, ctypes.c_void_p,
                                       ctypes.c_int, ctypes.c_void_p, ctypes.c_int]
    lib.pagoda_layer_norm_bf16.restype = None
    lib.pagoda_layer_norm_bf16.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int,
                                           ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_float,
                                           ctypes.c_void_p, ctypes.c_int]
    return lib


def available() -> bool:
    return _library() is not None


def unavailable_reason() -> str | None:
    """Why the kernels are not available (None when they are)."""
    return None if _library() is not None else _unavailable[0]


HEAD_DIMS = (16, 32, 64, 128)      # the head sizes the kernel is compiled for (its loops unrolled per size)


def supports(head_dim: int) -> bool:
    return head_dim in HEAD_DIMS


def attention(q: torch.Tensor, heads: int, q_starts: torch.Tensor, kv: torch.Tensor | None = None,
              kv_starts: torch.Tensor | None = None, rope: torch.Tensor | None = None,
              window: int | None = None) -> torch.Tensor:
    """softmax(q k^T / sqrt(hd)) v of each row's queries over its own keys, from bf16 GEMM results. Self-attention
    (`kv` None): `q` is a q|k|v GEMM's [T, 3 * hidden] output and `q_starts` the rows' first tokens, then their end;
    q and k are rotated by `rope` ([T, hd / 2] complex, each token's own position; q's and k's pairs interleaved as
    `packed_engine._interleave_rotary_pairs` orders them) when given, and `window` keeps only |i - j| <= window.
    Otherwise `q` is [Tq, hidden], `kv` a k|v GEMM's [T, 2 * hidden] output, and the starts of each are given
    apart. Starts are int32. Returns bf16 [Tq, hidden], zero after the last row's queries."""
    lib = _library()
    assert lib is not None, "the compiled kernels are not available here"
    self_attention = kv is None
    hidden = q.size(1) // 3 if self_attention else q.size(1)
    kv, kv_starts = (q, q_starts) if self_attention else (kv, kv_starts)
    assert kv is not None and kv_starts is not None and kv.size(1) == (3 if self_attention else 2) * hidden
    for t in (q, kv):
        assert t.dtype == torch.bfloat16 and t.dim() == 2 and t.stride(1) == 1
    assert q_starts.dtype == kv_starts.dtype == torch.int32 and q_starts.numel() == kv_starts.numel()
    assert supports(hidden // heads), f"head size {hidden // heads} is not one of {HEAD_DIMS}"
    assert self_attention or (rope is None and window is None), "rotary and windows are for self-attention"
    out = torch.empty(q.size(0), hidden, dtype=torch.bfloat16)
    table = None
    if rope is not None:
        table = torch.view_as_real(rope).contiguous()
        assert table.size(0) == q.size(0) and table.size(1) * 2 == hidden // heads
    q_starts, kv_starts = q_starts.contiguous(), kv_starts.contiguous()
    kv_ptr = kv.data_ptr() + (hidden * kv.element_size() if self_attention else 0)
    status = lib.pagoda_attention(q.data_ptr(), q.stride(0), q_starts.data_ptr(), q.size(0), kv_ptr, kv.stride(0),
                                  kv_starts.data_ptr(), q_starts.numel() - 1, heads, hidden // heads,
                                  None if table is None else table.data_ptr(), -1 if window is None else window,
                                  out.data_ptr(), torch.get_num_threads())
    if status != 0:
        raise MemoryError("attention could not allocate its buffers")
    return out


def add_widened(residual: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """residual (fp32) + y (bf16) as a new fp32 tensor: the bits of `torch.add(residual, y)`, faster."""
    lib = _library()
    assert lib is not None, "the compiled kernels are not available here"
    assert residual.dtype == torch.float32 and y.dtype == torch.bfloat16 and residual.shape == y.shape
    residual, y = residual.contiguous(), y.contiguous()
    out = torch.empty_like(residual)
    lib.pagoda_add_widened(residual.data_ptr(), y.data_ptr(), out.data_ptr(), out.numel(), torch.get_num_threads())
    return out


def layer_norm_bf16(x: torch.Tensor, weight: torch.Tensor | None, bias: torch.Tensor | None, eps: float,
                    add: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """F.layer_norm over the last dim of fp32 [T, d] `x` (d a multiple of 16), rounded once to bf16: the input of
    a bf16 GEMM without an fp32 intermediate. With `add` (bf16, x's shape), the norm is of x + add. Returns (the
    normed input's bf16, the fp32 tensor normed: x itself, or the new x + add)."""
    lib = _library()
    assert lib is not None, "the compiled kernels are not available here"
    assert x.dtype == torch.float32 and x.dim() == 2 and x.size(1) % 16 == 0
    assert add is None or (add.dtype == torch.bfloat16 and add.shape == x.shape)
    x = x.contiguous()
    add = None if add is None else add.contiguous()
    out = torch.empty(x.shape, dtype=torch.bfloat16)
    total = x if add is None else torch.empty_like(x)
    for t in (weight, bias):
        assert t is None or (t.dtype == torch.float32 and t.is_contiguous() and t.numel() == x.size(1))
    lib.pagoda_layer_norm_bf16(x.data_ptr(), None if add is None else add.data_ptr(), total.data_ptr(), x.size(0),
                               x.size(1), None if weight is None else weight.data_ptr(),
                               None if bias is None else bias.data_ptr(), eps, out.data_ptr(), torch.get_num_threads())
    return out, total


def rows_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """x @ weight.T + bias in fp32 for a few rows, each row's bits its own (see `pagoda_rows_linear`)."""
    lib = _library()
    assert lib is not None, "the compiled kernels are not available here"
    assert x.dtype == weight.dtype == torch.float32 and x.dim() == 2 and x.size(1) == weight.size(1)
    assert bias is None or (bias.dtype == torch.float32 and bias.numel() == weight.size(0))
    x, weight = x.contiguous(), weight.contiguous()
    bias = None if bias is None else bias.contiguous()
    y = torch.empty(x.size(0), weight.size(0))
    lib.pagoda_rows_linear(weight.data_ptr(), None if bias is None else bias.data_ptr(), weight.size(0), weight.size(1),
                           x.data_ptr(), x.size(0), y.data_ptr(), torch.get_num_threads())
    return y


if __name__ == "__main__":      # `make install` builds the kernels once, so a missing compiler shows there
    if available():
        print(f"laya.kernels: built {build()}")
    else:
        print(f"laya.kernels: {unavailable_reason()}; the bf16 engine will run its torch ops instead")
