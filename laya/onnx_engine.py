"""CPU inference on onnxruntime: rows packed into one token axis, exact fp32 or int8, no torch.

`laya.onnx_graph` builds the graph from the checkpoint's weights at load (a second or two at base
size, no export step, nothing cached on disk); weights are handed to onnxruntime as views of the
memory-mapped file or of one converted copy, which it prepacks for its GEMM kernels. A call runs the
main graph over every row at once (in chunks of `chunk_tokens` tokens, which cannot change a row's
result), computes the act features per row here, then the act head. See `laya.onnx_graph`
for why the result of a row does not depend on the other rows of the call.
"""

from __future__ import annotations

import os
import time
from typing import Any

import numpy as np

from laya.config import LayaConfig
from laya.engine import RowOutput, act_features, softmax
from laya.layout import check_shapes
from laya.onnx_graph import INPUTS, EncoderSpec, LayaGraph
from laya.packing import chunk_tokens, pack, token_chunks
from laya.precision import Plan, detect
from laya.rows import Row
from laya.weights import SafeTensors


def default_threads() -> int:
    """`$OMP_NUM_THREADS` when set (what torch honours too, so both runtimes get the same count), else
    0: onnxruntime's default, one thread per physical core."""
    raw = os.environ.get("OMP_NUM_THREADS", "")
    return int(raw) if raw.isdigit() and int(raw) > 0 else 0


class OnnxEngine:
    def __init__(self, encoder_config: dict[str, Any], config: LayaConfig, weights_path: str, plan: Plan,
                 threads: int | None = None):
        import onnxruntime as ort

        started = time.perf_counter()
        self.plan = plan
        self.config = config
        self.spec = EncoderSpec.from_config(encoder_config)
        self.weights = SafeTensors(weights_path)
        self.folder = os.path.dirname(os.path.abspath(weights_path))
        quantize = plan.precision == "int8"
        # u8 x s8 products are summed in pairs in 16 bits by the AVX2 kernel: 7-bit weights keep those
        # sums in range; VNNI's dot product accumulates in 32 bits, so 8-bit weights are safe there.
        self.weight_bits = 8 if detect().int8_dot else 7
        graph = LayaGraph(self.weights, self.spec, config, quantize, self.weight_bits)
        check_shapes(graph.tensor_shapes(), {n: self.weights.shape(n) for n in self.weights}, weights_path)
        self.threads = default_threads() if threads is None else threads
        self.chunk_tokens = chunk_tokens(self.threads)
        self._keep: list[Any] = []
        self.session = self._session(ort, *graph.build())
        self.act_session = self._session(ort, *graph.build_act_head())
        self.load_s = time.perf_counter() - started

    def _session(self, ort: Any, model: Any, weights: dict[str, np.ndarray]):
        opts = ort.SessionOptions()
        opts.intra_op_num_threads = self.threads
        opts.inter_op_num_threads = 1
        opts.execution_mode = ort.ExecutionMode.ORT_SEQUENTIAL
        opts.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
        opts.log_severity_level = 3
        opts.add_session_config_entry("session.model_external_initializers_file_folder_path", self.folder)
        for name, array in weights.items():
            value = ort.OrtValue.ortvalue_from_numpy(array)
            self._keep.append((array, value))     # onnxruntime reads this memory; it must outlive the session
            opts.add_initializer(name, value)
        return ort.InferenceSession(model.SerializeToString(), opts, providers=["CPUExecutionProvider"])

    def describe(self) -> dict:
        out = {**self.plan.summary(), "threads": self.threads or "onnxruntime default",
               "load_s": round(self.load_s, 2), "tokens_per_run": self.chunk_tokens}
        if self.plan.precision == "int8":
            out["int8"] = {"weights": f"per output channel, {self.weight_bits}-bit",
                           "activations": "per token, 8-bit", "accumulation": "int32"}
        return out

    def forward(self, rows: list[Row]) -> list[RowOutput]:
        return [out for chunk in token_chunks(rows, self.chunk_tokens) for out in self._run(chunk)]

    def _run(self, rows: list[Row]) -> list[RowOutput]:
        packed = pack(rows)
        logits, cls = self.session.run(None, {name: getattr(packed, name) for name in INPUTS})
        bounds = np.cumsum([0] + packed.marker_counts)
        per_row = [logits[bounds[i]:bounds[i + 1]].copy() for i in range(len(rows))]
        features = np.stack([act_features(lg) for lg in per_row])
        act = self.act_session.run(None, {"cls": cls, "features": features})[0]
        return [RowOutput(lg, softmax(a)) for lg, a in zip(per_row, act)]
