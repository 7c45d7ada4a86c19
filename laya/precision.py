"""Which arithmetic a process decides with, chosen once at load from what the CPU can really do.

- `exact` (default): fp32, answers within 1e-4 of the official runtime.
- `int8`: int8 weights (per output channel) and int8 activations (per token) with int32 accumulation,
  on onnxruntime's integer kernels; any x86-64 CPU with AVX2 runs it, VNNI makes it faster.
- `bf16`: bf16 weights and activations through torch/oneDNN, only where the CPU has AMX-BF16 or
  AVX512-BF16 (or on a GPU): emulated bf16 is slower than fp32, so it is refused, not run.
- `fast`: the best reduced precision this machine has (bf16 where it has the units, else int8).

Features are read from the CPU at load (`/proc/cpuinfo` flags), never assumed, and reported by
`pagoda bench decide` and serving's `/health`. Per token, not per batch, activation scales are what
keep int8 answers independent of what shares a batch (see `laya.onnx_graph`).
"""

from __future__ import annotations

import os
import platform
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

PRECISIONS = ("exact", "int8", "bf16", "fast")
PRECISION_ENV = "PAGODA_PRECISION"
DEFAULT_PRECISION = "exact"

# The flags that decide a path, as /proc/cpuinfo spells them.
BF16_UNITS = ("amx_bf16", "avx512_bf16")
INT8_DOT = ("avx512_vnni", "avx_vnni", "amx_int8")
REPORTED = ("avx2", "fma", "avx512f", *INT8_DOT, *BF16_UNITS)


@dataclass(frozen=True)
class CpuFeatures:
    model: str
    flags: frozenset[str]
    cores: int

    @property
    def bf16_units(self) -> list[str]:
        return [f for f in BF16_UNITS if f in self.flags]

    @property
    def int8_dot(self) -> list[str]:
        return [f for f in INT8_DOT if f in self.flags]

    def summary(self) -> dict:
        return {"model": self.model, "cores": self.cores, "flags": [f for f in REPORTED if f in self.flags],
                "bf16_units": self.bf16_units, "int8_dot_product": self.int8_dot}


def parse_cpuinfo(text: str) -> tuple[str, frozenset[str]]:
    """(model name, flags) of the first processor block of a `/proc/cpuinfo` text."""
    model, flags = "", frozenset()
    for line in text.splitlines():
        key, _, value = line.partition(":")
        key = key.strip()
        if key == "model name" and not model:
            model = value.strip()
        elif key in ("flags", "Features") and not flags:
            flags = frozenset(value.split())
    return model, flags


@lru_cache(maxsize=1)
def detect() -> CpuFeatures:
    """This machine's CPU. Linux reports flags in /proc/cpuinfo; elsewhere none are claimed, so only
    the paths that need no special unit (exact, int8 on any x86-64 with AVX2 via onnxruntime) are offered."""
    path = Path("/proc/cpuinfo")
    text = path.read_text(encoding="utf-8", errors="replace") if path.is_file() else ""
    model, flags = parse_cpuinfo(text)
    return CpuFeatures(model or platform.processor() or platform.machine(), flags, os.cpu_count() or 1)


@dataclass(frozen=True)
class Plan:
    """What `laya.load` runs: `precision` is one of exact/int8/bf16 (never `fast`), `backend` the runtime."""

    requested: str
    precision: str
    backend: str            # "onnxruntime" or "torch"
    device: str
    reason: str

    def summary(self) -> dict:
        return {"requested": self.requested, "precision": self.precision, "backend": self.backend,
                "device": self.device, "reason": self.reason}


def requested_precision(precision: str | None) -> str:
    """The argument, else `$PAGODA_PRECISION`, else exact; an unknown name is refused by name."""
    value = precision if precision is not None else (os.environ.get(PRECISION_ENV) or DEFAULT_PRECISION)
    value = value.strip().lower() if isinstance(value, str) else value
    if value not in PRECISIONS:
        where = "precision" if precision is not None else f"${PRECISION_ENV}"
        raise ValueError(f"{where}: expected one of {', '.join(PRECISIONS)}, got {value!r}")
    return value


def check_device(device: str, where: str = "--device") -> str:
    """`device` as given, once torch can run on it; else a ValueError naming the flag and what is missing.

    Without this a CPU-only torch meets `--device cuda` deep inside the first `.to()` (an AssertionError
    after the corpus is built, in a training run) and an unknown name as torch's list of every device type.
    "cpu" never imports torch: the CPU engines load without it. `where` names the setting in the error."""
    device = str(device)
    if device == "cpu":
        return device
    import torch

    try:
        dev = torch.device(device)
    except (RuntimeError, ValueError):
        raise ValueError(f"{where}: {device!r} is not a device name (cpu, cuda, cuda:N, mps)") from None
    if dev.type == "cpu":
        return device
    backends = {"cuda": torch.cuda, "mps": getattr(torch.backends, "mps", None)}
    backend = backends.get(dev.type)
    if backend is None or not backend.is_available():
        raise ValueError(f"{where}: {device!r} is not available to this torch ({torch.__version__}): no {dev.type} "
                         "device is visible or torch was built without it; use 'cpu'")
    count = backend.device_count() if hasattr(backend, "device_count") else 1
    if dev.index is not None and dev.index >= count:
        raise ValueError(f"{where}: {device!r} asks for {dev.type} device {dev.index}, but torch sees {count}")
    return device


def plan(precision: str | None, device: str = "cpu", cpu: CpuFeatures | None = None) -> Plan:
    """Resolve a request into a runnable plan, or refuse with what is missing.

    On CPU, exact and int8 run on onnxruntime (packed rows, prepacked weights); bf16 runs packed rows on
    torch's oneDNN bf16 GEMMs (`laya.packed_engine`). On a
    GPU everything is torch: exact is fp32, bf16 autocasts, int8 has no kernels here and is refused.
    """
    requested = requested_precision(precision)
    device = str(device)
    if device != "cpu":
        if requested == "int8":
            raise ValueError(f"precision 'int8' runs on CPU only (onnxruntime's integer kernels); device {device!r} "
                             "can run 'exact' or 'bf16'")
        if requested in ("bf16", "fast"):
            return Plan(requested, "bf16", "torch", device, f"{device}: bf16 autocast")
        return Plan(requested, "exact", "torch", device, f"{device}: fp32")
    cpu = cpu or detect()
    units = cpu.bf16_units
    if requested == "exact":
        return Plan(requested, "exact", "onnxruntime", device, "fp32 (default)")
    if requested == "bf16" or (requested == "fast" and units):
        if not units:
            raise ValueError(f"precision 'bf16' needs a CPU with {' or '.join(BF16_UNITS)}; this CPU "
                             f"({cpu.model or 'unknown'}) has neither, and emulated bf16 is slower than fp32. "
                             "Use 'int8' (or 'fast', which picks int8 here)")
        return Plan(requested, "bf16", "torch", device, f"bf16 units: {', '.join(units)}")
    dot = cpu.int8_dot
    why = f"no {' / '.join(BF16_UNITS)}; " if requested == "fast" else ""
    if dot:
        why += f"int8 dot product: {', '.join(dot)}"
    elif "avx2" in cpu.flags:
        why += "int8 on AVX2 (no VNNI: 7-bit weights avoid saturation)"
    else:
        why += "int8 on onnxruntime's portable integer kernels (7-bit weights)"
    return Plan(requested, "int8", "onnxruntime", device, why)
