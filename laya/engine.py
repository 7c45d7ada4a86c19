"""What an inference engine gives the `Agent`: one `RowOutput` per row, whatever runs the model.

Three engines exist: `laya.onnx_engine` (CPU, exact fp32 and int8, torch-free), `laya.packed_engine`
(CPU bf16: packed rows, bf16 GEMMs on torch/oneDNN) and `laya.torch_engine` (the `LayaModel` module:
GPUs, and encoders the packed paths do not build); `laya.load` picks one from the `laya.precision.Plan`. Both feed the act head the same four features of the option
distribution, defined once here (`act_features`; `laya.modeling_laya` has the differentiable twin).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import numpy as np

from laya.precision import Plan
from laya.rows import Row

ACT_HIDDEN = 256               # width of the act head's hidden layer
HEAD_DIM = 64                  # the head's transformer layers have max(1, d // 64) attention heads
MAX_OPTIONS_FEATURE = 255.0    # option counts are fed to the act head as k / 255


@dataclass
class RowOutput:
    logits: np.ndarray             # float32 [k], slot order, untempered
    act_probabilities: np.ndarray  # float32 [n_act]


class Engine(Protocol):
    plan: Plan

    def forward(self, rows: list[Row]) -> list[RowOutput]:
        """One output per row, in order; a row's bits never depend on the other rows of the call."""

    def describe(self) -> dict:
        """Precision, backend and threads, for `/health` and `pagoda bench decide`."""


def act_features(logits: np.ndarray) -> np.ndarray:
    """[top1, top1 - top2, entropy / ln k, k / 255] of one row's untempered option distribution, float32."""
    x = logits.astype(np.float32)
    e = np.exp(x - x.max())
    p = e / e.sum(dtype=np.float32)
    k = np.float32(max(len(x), 2))
    entropy = -(p * np.log(np.maximum(p, np.float32(1e-9)))).sum(dtype=np.float32) / np.log(k)
    top = np.sort(p)[::-1]
    second = top[1] if len(top) > 1 else np.float32(0.0)   # one slot: the gap to a missing second is 1
    return np.array([top[0], top[0] - second, entropy, k / np.float32(MAX_OPTIONS_FEATURE)], dtype=np.float32)


def softmax(x: np.ndarray) -> np.ndarray:
    e = np.exp(x - x.max())
    return e / e.sum(dtype=np.float32)
