"""The Laya model as an ONNX graph over packed rows, built straight from checkpoint weights (no torch).

Why a graph of our own rather than an export of `LayaModel`: the graph takes every row of a call
*packed* into one token axis, without padding, and that is what makes it both fast and exact:

- every matmul runs once over all tokens of all rows (one large GEMM per weight, weights prepacked by
  onnxruntime at load), and no FLOP is spent on padding;
- attention runs row by row inside an ONNX `Loop`, over exactly that row's tokens, so no reduction
  ever sees another row or a padded length. Every other op works token by token, and onnxruntime's
  kernels compute a token's values the same way wherever it sits in the packed axis (the tests check
  it), so a row's bits do not depend on what else shares the call.

int8 (`quantize=True`) swaps each large linear for per-token symmetric activations (scale = the
token's max |x| / 127, uint8 with zero point 128) times per-output-channel int8 weights, accumulated
exactly in int32 by onnxruntime's integer GEMM: a token's scale is its own, so int8 keeps the
batch-mate invariance. On AVX2 without VNNI the u8*s8 kernel adds pairs of products in 16 bits, so
weights use 7 bits (|q| <= 63) to keep those sums from saturating; with VNNI they use 8.

Supported encoders: ModernBERT (pre-norm, rotary, local/global attention, GeGLU) and BERT (post-norm,
absolute positions). Anything else raises `Unsupported` and `laya.load` runs the torch model instead.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

from laya.config import LayaConfig
from laya.engine import ACT_HIDDEN, HEAD_DIM
from laya.layout import WEIGHTS_FILE
from laya.weights import SafeTensors

OPSET = 21
MS_DOMAIN = "com.microsoft"
_FLOAT = 1                                             # onnx TensorProto.FLOAT
_STORED_TYPES = {"F32": 1, "F16": 10, "BF16": 16}      # safetensors dtype -> onnx TensorProto type
HEAD_EPS = 1e-5            # nn.LayerNorm / nn.TransformerEncoderLayer defaults used by LayaModel's head

# Inputs of the main graph: all rows of one call packed along one token axis.
INPUTS = {
    "input_ids": "[T] token ids, rows one after another",
    "positions": "[T] position of each token in its own row",
    "token_qtype": "[T] question type of each token's row",
    "row_starts": "[R+1] where each row begins in the token axis (last entry: T)",
    "select": "[P] token index of each row's [CLS] then its option markers, rows in order",
    "select_starts": "[R+1] where each row's entries begin in `select`",
    "marker_select": "[M] positions in `select` of the option markers",
    "cls_select": "[R] positions in `select` of the [CLS] tokens",
}
OUTPUTS = ("logits", "cls")           # [M] untempered option logits, [R, d] head output at [CLS]
EXTERNAL_FILE = WEIGHTS_FILE          # what the external-data declarations name, in the checkpoint folder


class Unsupported(ValueError):
    """The checkpoint's encoder is not one this graph builds; the torch model can still run it."""


_ACTIVATIONS = {"gelu": "gelu", "gelu_new": "gelu_tanh", "gelu_pytorch_tanh": "gelu_tanh", "relu": "relu",
                "silu": "silu", "swish": "silu"}


@dataclass(frozen=True)
class EncoderSpec:
    """What the graph needs from `encoder/config.json`, with transformers' defaults spelled out here
    (reading the JSON ourselves keeps transformers, and through it torch, out of the load)."""

    arch: str                     # "modernbert" | "bert"
    hidden: int
    heads: int
    layers: int
    intermediate: int
    eps: float
    activation: str
    max_positions: int
    vocab: int
    type_vocab: int = 0
    # ModernBERT
    layer_types: tuple[str, ...] = ()
    window: int = 0               # half window: |i - j| <= window attends in sliding layers
    rope_theta: dict[str, float] = field(default_factory=dict)
    norm_bias: bool = False
    attention_bias: bool = False
    mlp_bias: bool = False

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads

    @classmethod
    def from_config(cls, cfg: dict[str, Any]) -> EncoderSpec:
        kind = cfg.get("model_type")
        act_key = "hidden_activation" if kind == "modernbert" else "hidden_act"
        act = _ACTIVATIONS.get(cfg.get(act_key, "gelu"))
        if act is None:
            raise Unsupported(f"encoder activation {cfg.get(act_key)!r}")
        common = dict(hidden=int(cfg["hidden_size"]), heads=int(cfg["num_attention_heads"]),
                      layers=int(cfg["num_hidden_layers"]), intermediate=int(cfg["intermediate_size"]),
                      activation=act, vocab=int(cfg["vocab_size"]))
        if common["hidden"] % common["heads"]:
            raise Unsupported("hidden_size is not a multiple of num_attention_heads")
        if kind == "modernbert":
            n = common["layers"]
            every = int(cfg.get("global_attn_every_n_layers", 3))
            types = tuple(cfg.get("layer_types") or ["full_attention" if i % every == 0 else "sliding_attention"
                                                     for i in range(n)])
            rope = cfg.get("rope_parameters") or {}
            theta = {}
            for t, default in (("full_attention", cfg.get("global_rope_theta", 160000.0)),
                               ("sliding_attention", cfg.get("local_rope_theta", 10000.0))):
                params = rope.get(t) or {"rope_theta": default, "rope_type": "default"}
                if params.get("rope_type", "default") != "default":
                    raise Unsupported(f"ModernBERT rope_type {params.get('rope_type')!r}")
                theta[t] = float(params["rope_theta"])
            if cfg.get("head_dim") not in (None, common["hidden"] // common["heads"]):
                raise Unsupported("ModernBERT head_dim other than hidden_size / num_attention_heads")
            return cls("modernbert", **common, eps=float(cfg.get("norm_eps", 1e-5)),
                       max_positions=int(cfg.get("max_position_embeddings", 8192)), layer_types=types,
                       window=int(cfg.get("local_attention", 128)) // 2, rope_theta=theta,
                       norm_bias=bool(cfg.get("norm_bias", False)), attention_bias=bool(cfg.get("attention_bias", False)),
                       mlp_bias=bool(cfg.get("mlp_bias", False)))
        if kind == "bert":
            if cfg.get("position_embedding_type", "absolute") != "absolute":
                raise Unsupported(f"BERT position_embedding_type {cfg.get('position_embedding_type')!r}")
            return cls("bert", **common, eps=float(cfg.get("layer_norm_eps", 1e-12)),
                       max_positions=int(cfg.get("max_position_embeddings", 512)),
                       type_vocab=int(cfg.get("type_vocab_size", 2)))
        raise Unsupported(f"encoder model_type {kind!r} (the ONNX path builds modernbert and bert)")

    def rope_tables(self, theta: float) -> tuple[np.ndarray, np.ndarray]:
        """cos and sin of position * inverse frequency, [max positions, head_dim / 2], as transformers computes."""
        hd = self.head_dim
        inv_freq = (1.0 / (np.float32(theta) ** (np.arange(0, hd, 2, dtype=np.float32) / np.float32(hd))))
        freqs = np.arange(self.max_positions, dtype=np.float32)[:, None] * inv_freq.astype(np.float32)[None]
        return np.cos(freqs).astype(np.float32), np.sin(freqs).astype(np.float32)

    def tensor_shapes(self) -> dict[str, tuple[int, ...]]:
        """The encoder's checkpoint tensors (`encoder.*`), as transformers names and shapes them."""
        d, i, p = self.hidden, self.intermediate, "encoder."
        out: dict[str, tuple[int, ...]] = {}

        def norm(name: str, bias: bool = True) -> None:
            out[name + ".weight"] = (d,)
            if bias:
                out[name + ".bias"] = (d,)

        def linear(name: str, n_out: int, n_in: int, bias: bool = True) -> None:
            out[name + ".weight"] = (n_out, n_in)
            if bias:
                out[name + ".bias"] = (n_out,)

        if self.arch == "modernbert":
            out[p + "embeddings.tok_embeddings.weight"] = (self.vocab, d)
            norm(p + "embeddings.norm", self.norm_bias)
            for n in range(self.layers):
                lp = f"{p}layers.{n}."
                if n:
                    norm(lp + "attn_norm", self.norm_bias)
                linear(lp + "attn.Wqkv", 3 * d, d, self.attention_bias)
                linear(lp + "attn.Wo", d, d, self.attention_bias)
                norm(lp + "mlp_norm", self.norm_bias)
                linear(lp + "mlp.Wi", 2 * i, d, self.mlp_bias)
                linear(lp + "mlp.Wo", d, i, self.mlp_bias)
            norm(p + "final_norm", self.norm_bias)
            return out
        out[p + "embeddings.word_embeddings.weight"] = (self.vocab, d)
        out[p + "embeddings.position_embeddings.weight"] = (self.max_positions, d)
        out[p + "embeddings.token_type_embeddings.weight"] = (self.type_vocab, d)
        norm(p + "embeddings.LayerNorm")
        for n in range(self.layers):
            lp = f"{p}encoder.layer.{n}."
            for part in ("query", "key", "value"):
                linear(lp + "attention.self." + part, d, d)
            linear(lp + "attention.output.dense", d, d)
            norm(lp + "attention.output.LayerNorm")
            linear(lp + "intermediate.dense", i, d)
            linear(lp + "output.dense", d, i)
            norm(lp + "output.LayerNorm")
        linear(p + "pooler.dense", d, d)   # BertModel's pooler: stored, never read by Laya
        return out

    def linear_macs(self, tokens: int, selected: int, head_layers: int) -> int:
        """Multiply-adds of every linear layer the graph runs: encoder and all but the last head layer
        at every token; the last head layer's keys/values at every token, the rest at `selected` only."""
        d, i = self.hidden, self.intermediate
        per_token = (3 * d * d + d * d + d * i * 2 + i * d) if self.arch == "modernbert" else (4 * d * d + 2 * d * i)
        macs = tokens * per_token * self.layers
        if head_layers:
            full = 4 * d * d + 2 * d * 4 * d
            macs += tokens * (full * (head_layers - 1) + 2 * d * d) + selected * (2 * d * d + 8 * d * d)
        return macs

    def attention_macs(self, lengths: list[int], head_layers: int, selected: list[int]) -> int:
        d = self.hidden
        macs = 0
        for n, s in zip(lengths, selected):
            if self.arch == "modernbert":
                for t in self.layer_types:
                    span = n if t == "full_attention" else min(n, 2 * self.window + 1)
                    macs += 2 * n * span * d
            else:
                macs += 2 * n * n * d * self.layers
            if head_layers:
                macs += 2 * n * n * d * (head_layers - 1) + 2 * s * n * d
        return macs


class _Builder:
    """Nodes, small constants and large weights of one graph (or of a Loop body)."""

    def __init__(self, prefix: str = ""):
        from onnx import helper

        self.helper = helper
        self.prefix = prefix
        self.nodes: list[Any] = []
        self.constants: list[Any] = []
        self.weights: dict[str, np.ndarray] = {}   # name -> array handed to onnxruntime without a copy
        self.declared: list[Any] = []              # initializers whose bytes onnxruntime reads from the file
        self._n = 0

    def fresh(self, hint: str) -> str:
        self._n += 1
        return f"{self.prefix}{hint}_{self._n}"

    def op(self, op_type: str, *inputs: str, n_out: int = 1, domain: str = "", **attrs: Any) -> Any:
        outs = [self.fresh(op_type.lower()) for _ in range(n_out)]
        self.nodes.append(self.helper.make_node(op_type, list(inputs), outs, domain=domain or None, **attrs))
        return outs[0] if n_out == 1 else outs

    def const(self, value: Any, dtype: Any = np.float32) -> str:
        from onnx import numpy_helper

        name = self.fresh("c")
        self.constants.append(numpy_helper.from_array(np.asarray(value, dtype=dtype), name))
        return name

    def weight(self, array: np.ndarray, hint: str = "w") -> str:
        """An array computed here (int8 weights, scales, rotary tables), handed over in memory."""
        name = self.fresh(hint)
        self.weights[name] = np.ascontiguousarray(array)
        return name

    def file_weight(self, onnx_type: int, shape: tuple[int, ...], offset: int, length: int) -> str:
        """A tensor stored in the checkpoint file at `offset`, read from there by onnxruntime."""
        name = self.fresh("f")
        self.declared.append(_external(name, onnx_type, shape, offset, length))
        return name


class LayaGraph:
    """Builds the main graph (`build`) and the act head's (`build_act_head`) of one checkpoint."""

    def __init__(self, weights: SafeTensors, spec: EncoderSpec, config: LayaConfig, quantize: bool = False,
                 weight_bits: int = 7):
        self.w = weights
        self.spec = spec
        self.config = config
        self.quantize = quantize
        self.qmax = 2 ** (weight_bits - 1) - 1
        self.head_heads = max(1, spec.hidden // HEAD_DIM)
        self._start()

    def _start(self) -> None:
        self.b = _Builder()
        self._shared: dict[str, str] = {}
        self._quantized: dict[str, tuple[str, str]] = {}

    def tensor_shapes(self) -> dict[str, tuple[int, ...]]:
        """Every tensor the checkpoint must hold for this graph (the names `LayaModel.state_dict` uses)."""
        d = self.spec.hidden
        out = self.spec.tensor_shapes()
        out["type_emb.weight"] = (3, d)
        for i in range(self.config.head_layers):
            lp = f"head.layers.{i}."
            out.update({lp + "self_attn.in_proj_weight": (3 * d, d), lp + "self_attn.in_proj_bias": (3 * d,),
                        lp + "self_attn.out_proj.weight": (d, d), lp + "self_attn.out_proj.bias": (d,),
                        lp + "linear1.weight": (4 * d, d), lp + "linear1.bias": (4 * d,),
                        lp + "linear2.weight": (d, 4 * d), lp + "linear2.bias": (d,)})
            for n in ("norm1", "norm2"):
                out[lp + n + ".weight"] = out[lp + n + ".bias"] = (d,)
        out.update({"scorer.0.weight": (d,), "scorer.0.bias": (d,), "scorer.1.weight": (d, d), "scorer.1.bias": (d,),
                    "scorer.3.weight": (1, d), "scorer.3.bias": (1,),
                    "act_head.0.weight": (ACT_HIDDEN, d + 4), "act_head.0.bias": (ACT_HIDDEN,),
                    "act_head.2.weight": (self.config.n_act, ACT_HIDDEN), "act_head.2.bias": (self.config.n_act,),
                    "temperature": (3,)})
        return out

    # -- weights and linears ------------------------------------------------------------------------

    def param(self, name: str, rows: slice | None = None) -> str:
        """A checkpoint tensor (or a range of its rows) as float32, read by onnxruntime from the file;
        F16/BF16 ones are widened by a Cast that onnxruntime folds once at load."""
        key = f"{name}[{rows}]"
        if key not in self._shared:
            offset, length, shape = self.w.span(name, rows)
            stored = self.b.file_weight(_STORED_TYPES[self.w.dtype(name)], shape, offset, length)
            self._shared[key] = stored if self.w.dtype(name) == "F32" else self.b.op("Cast", stored, to=_FLOAT)
        return self._shared[key]

    def linear(self, x: str, weight: str, bias: str | None = None, quantize: bool = True,
               rows: slice | None = None) -> str:
        """x @ W.T + b for a checkpoint weight W [out, in] (`rows` takes a range of W's outputs)."""
        if self.quantize and quantize:
            w = self.w.float32(weight)[rows or slice(None)]
            bvec = self.w.float32(bias)[rows or slice(None)] if bias is not None else None
            return self._int8_linear(x, w, bvec)
        inputs = [x, self.param(weight, rows)] + ([self.param(bias, rows)] if bias is not None else [])
        return self.b.op("Gemm", *inputs, transB=1)

    def _int8_linear(self, x: str, w: np.ndarray, bias: np.ndarray | None) -> str:
        b = self.b
        scale = np.abs(w).max(axis=1) / self.qmax
        scale = np.where(scale > 0, scale, 1.0).astype(np.float32)
        wq = np.clip(np.rint(w / scale[:, None]), -self.qmax, self.qmax).astype(np.int8)
        if x not in self._quantized:   # q, k and v (and GeGLU's halves) share one quantised input
            amax = b.op("ReduceMax", b.op("Abs", x), b.const([1], np.int64), keepdims=0)
            step = b.op("Max", b.op("Mul", amax, b.const(np.float32(1 / 127))), b.const(np.float32(1e-30)))
            zero_points = b.op("Expand", b.const(np.uint8(128), np.uint8), b.op("Shape", step))
            u8 = b.op("QuantizeLinear", x, step, zero_points, axis=0)     # per token: its own step
            self._quantized[x] = (u8, b.op("Unsqueeze", step, b.const([1], np.int64)))
        u8, step = self._quantized[x]
        y = b.op("MatMulIntegerToFloat", u8, b.weight(wq.T, "wq"), b.const(np.float32(1.0)), b.weight(scale, "ws"),
                 b.const(np.uint8(128), np.uint8), domain=MS_DOMAIN)
        y = b.op("Mul", y, step)
        return y if bias is None else b.op("Add", y, b.weight(bias, "bias"))

    def norm(self, x: str, prefix: str, eps: float, bias: bool = True) -> str:
        inputs = [x, self.param(prefix + ".weight")]
        if bias:
            inputs.append(self.param(prefix + ".bias"))
        return self.b.op("LayerNormalization", *inputs, axis=-1, epsilon=eps)

    def act(self, x: str, kind: str) -> str:
        b = self.b
        if kind == "gelu":
            return b.op("Gelu", x)
        if kind == "gelu_tanh":
            return b.op("Gelu", x, approximate="tanh")
        if kind == "relu":
            return b.op("Relu", x)
        return b.op("Mul", x, b.op("Sigmoid", x))

    # -- attention, one row at a time ---------------------------------------------------------------

    def attention(self, q: str, k: str, v: str, q_starts: str, kv_starts: str, heads: int,
                  window: int | None = None) -> str:
        """softmax(q k^T / sqrt(hd)) v per row, in an ONNX Loop over rows (one fused attention op per row,
        over exactly that row's tokens); row r's queries are q[q_starts[r]:q_starts[r+1]] and it attends to
        k, v[kv_starts[r]:kv_starts[r+1]]; `window`: only |i - j| <= window (same positions)."""
        from onnx import TensorProto, helper

        b = self.b
        body = _Builder(prefix=b.fresh("loop") + "/")
        axis1 = body.const([1], np.int64)
        q_lo, q_hi = (body.op("Gather", bound, "i") for bound in self._bounds(q_starts))
        kv_lo, kv_hi = (q_lo, q_hi) if kv_starts == q_starts else (body.op("Gather", bound, "i")
                                                                   for bound in self._bounds(kv_starts))
        qr = body.op("Slice", self._batched(q), q_lo, q_hi, axis1)        # [1, n_q, d]
        kr = body.op("Slice", self._batched(k), kv_lo, kv_hi, axis1)
        vr = body.op("Slice", self._batched(v), kv_lo, kv_hi, axis1)
        extra = []
        if window is not None:   # the row's corner of one [1, 1, L, L] table built per call
            n = body.op("Sub", kv_hi, kv_lo)
            bias = body.op("Slice", self._window_bias(kv_starts, window), body.const([0, 0], np.int64),
                           body.op("Concat", n, n, axis=0), body.const([2, 3], np.int64))
            extra = ["", "", bias]
        out = body.op("MultiHeadAttention", qr, kr, vr, *extra, domain=MS_DOMAIN, num_heads=heads)   # [1, n_q, d]
        # Scan outputs must share a shape: each row's output is padded to the longest row, and the valid
        # tokens are gathered back after the loop (a sequence of tensors would copy itself per insert).
        longest, index = self._unpad(q_starts)
        pads = body.op("Concat", body.const([0, 0, 0, 0], np.int64), body.op("Sub", longest, body.op("Sub", q_hi, q_lo)),
                       body.const([0], np.int64), axis=0)
        body.nodes.append(helper.make_node("Pad", [out, pads], ["row_out"]))
        body.nodes.append(helper.make_node("Identity", ["cond_in"], ["cond_out"]))
        graph = helper.make_graph(
            body.nodes, body.prefix + "body",
            [helper.make_tensor_value_info("i", TensorProto.INT64, []),
             helper.make_tensor_value_info("cond_in", TensorProto.BOOL, [])],
            [helper.make_tensor_value_info("cond_out", TensorProto.BOOL, []),
             helper.make_tensor_value_info("row_out", TensorProto.FLOAT, None)],
            body.constants)
        n_rows = b.op("Squeeze", b.op("Sub", b.op("Shape", q_starts), b.const([1], np.int64)))
        stacked = b.op("Loop", n_rows, b.const(True, np.bool_), body=graph)               # [R, 1, L, d]
        flat = b.op("Reshape", stacked, b.const([-1, self.spec.hidden], np.int64))
        return b.op("Gather", flat, index)

    def _unpad(self, starts: str) -> tuple[str, str]:
        """([1] the longest row's length L, [T] where each packed token sits in an [R * L] row-padded axis)."""
        key = "unpad:" + starts
        if key not in self._shared:
            b = self.b
            lo, hi = self._bounds(starts)                                                   # [R, 1] each
            longest = b.op("ReduceMax", b.op("Sub", hi, lo), keepdims=0)
            total = b.op("Squeeze", b.op("Slice", starts, b.const([-1], np.int64), b.const([np.iinfo(np.int64).max],
                                                                                               np.int64)))
            t = b.op("Unsqueeze", b.op("Range", b.const(0, np.int64), total, b.const(1, np.int64)), b.const([0], np.int64))
            row = b.op("Sub", b.op("ReduceSum", b.op("Cast", b.op("LessOrEqual", lo, t), to=7), b.const([0], np.int64),
                                   keepdims=0), b.const(1, np.int64))                       # [T] row of each token
            offset = b.op("Sub", b.op("Squeeze", t, b.const([0], np.int64)),
                          b.op("Squeeze", b.op("Gather", lo, row), b.const([1], np.int64)))
            index = b.op("Add", b.op("Mul", row, longest), offset)
            self._shared[key] = (b.op("Unsqueeze", longest, b.const([0], np.int64)), index)
        return self._shared[key]

    def _bounds(self, starts: str) -> tuple[str, str]:
        """[R, 1] first and one-past-last token of each row, computed once per graph for `starts`."""
        key = "bounds:" + starts
        if key not in self._shared:
            b = self.b
            lo = b.op("Slice", starts, b.const([0], np.int64), b.const([-1], np.int64))
            hi = b.op("Slice", starts, b.const([1], np.int64), b.const([np.iinfo(np.int64).max], np.int64))
            self._shared[key] = (b.op("Unsqueeze", lo, b.const([1], np.int64)),
                                 b.op("Unsqueeze", hi, b.const([1], np.int64)))
        return self._shared[key]

    def _batched(self, x: str) -> str:
        """[T, d] as [1, T, d], the layout the fused attention op takes."""
        key = "batched:" + x
        if key not in self._shared:
            self._shared[key] = self.b.op("Unsqueeze", x, self.b.const([0], np.int64))
        return self._shared[key]

    def _window_bias(self, starts: str, window: int) -> str:
        """[1, 1, L, L] additive bias, 0 where |i - j| <= window and -inf elsewhere, L the longest row."""
        key = f"window:{starts}:{window}"
        if key not in self._shared:
            b = self.b
            lo, hi = self._bounds(starts)
            longest = b.op("ReduceMax", b.op("Sub", hi, lo), keepdims=0)
            idx = b.op("Range", b.const(0, np.int64), longest, b.const(1, np.int64))
            dist = b.op("Abs", b.op("Sub", b.op("Unsqueeze", idx, b.const([1], np.int64)),
                                    b.op("Unsqueeze", idx, b.const([0], np.int64))))
            bias = b.op("Where", b.op("Greater", dist, b.const(window, np.int64)), b.const(np.float32(-np.inf)),
                        b.const(np.float32(0.0)))
            self._shared[key] = b.op("Unsqueeze", bias, b.const([0, 1], np.int64))
        return self._shared[key]

    # -- encoders -----------------------------------------------------------------------------------

    def _rotary(self, x: str, positions: str, cos: str, sin: str) -> str:
        """Rotary embedding, rotate-half convention, by each token's position in its own row (one fused op)."""
        b, h = self.b, self.spec.heads
        out = b.op("RotaryEmbedding", b.op("Unsqueeze", x, b.const([0], np.int64)), positions, cos, sin,
                   domain=MS_DOMAIN, interleaved=0, num_heads=h)
        return b.op("Squeeze", out, b.const([0], np.int64))

    def _embedding(self, name: str, ids: str) -> str:
        """Rows of an embedding table; an F16 table stays F16 in memory and rows are widened as read."""
        if self.w.dtype(name) != "F16":
            return self.b.op("Gather", self.param(name), ids)
        offset, length, shape = self.w.span(name)
        table = self.b.file_weight(_STORED_TYPES["F16"], shape, offset, length)
        return self.b.op("Cast", self.b.op("Gather", table, ids), to=_FLOAT)

    def modernbert(self, ids: str, positions: str, starts: str) -> str:
        s, b, p = self.spec, self.b, "encoder."
        x = self.norm(self._embedding(p + "embeddings.tok_embeddings.weight", ids), p + "embeddings.norm", s.eps,
                      s.norm_bias)
        tables = {}
        pos = b.op("Unsqueeze", positions, b.const([0], np.int64))
        for t in sorted(set(s.layer_types)):
            cos, sin = s.rope_tables(s.rope_theta[t])
            tables[t] = (b.weight(cos, "cos"), b.weight(sin, "sin"))
        bias = (lambda n: n) if s.attention_bias else (lambda n: None)
        for i, t in enumerate(s.layer_types):
            lp = f"{p}layers.{i}."
            a = x if i == 0 else self.norm(x, lp + "attn_norm", s.eps, s.norm_bias)
            # One GEMM per output slice rather than a Split of one: no copy of [T, 3d] afterwards.
            q, k, v = (self.linear(a, lp + "attn.Wqkv.weight", bias(lp + "attn.Wqkv.bias"),
                                   rows=slice(j * s.hidden, (j + 1) * s.hidden)) for j in range(3))
            cos, sin = tables[t]
            attn = self.attention(self._rotary(q, pos, cos, sin), self._rotary(k, pos, cos, sin), v, starts, starts, s.heads,
                                  s.window if t == "sliding_attention" else None)
            x = b.op("Add", x, self.linear(attn, lp + "attn.Wo.weight", bias(lp + "attn.Wo.bias")))
            m = self.norm(x, lp + "mlp_norm", s.eps, s.norm_bias)
            mb = (lambda n: n) if s.mlp_bias else (lambda n: None)
            inp, gate = (self.linear(m, lp + "mlp.Wi.weight", mb(lp + "mlp.Wi.bias"),
                                     rows=slice(j * s.intermediate, (j + 1) * s.intermediate)) for j in range(2))
            x = b.op("Add", x, self.linear(b.op("Mul", self.act(inp, s.activation), gate), lp + "mlp.Wo.weight",
                                           mb(lp + "mlp.Wo.bias")))
        return self.norm(x, p + "final_norm", s.eps, s.norm_bias)

    def bert(self, ids: str, positions: str, starts: str) -> str:
        s, b, p = self.spec, self.b, "encoder."
        words = self._embedding(p + "embeddings.word_embeddings.weight", ids)
        token_type = b.weight(self.w.float32(p + "embeddings.token_type_embeddings.weight")[0], "tt")
        x = b.op("Add", b.op("Add", words, token_type), self._embedding(p + "embeddings.position_embeddings.weight",
                                                                         positions))
        x = self.norm(x, p + "embeddings.LayerNorm", s.eps)
        for i in range(s.layers):
            lp = f"{p}encoder.layer.{i}."
            q = self.linear(x, lp + "attention.self.query.weight", lp + "attention.self.query.bias")
            k = self.linear(x, lp + "attention.self.key.weight", lp + "attention.self.key.bias")
            v = self.linear(x, lp + "attention.self.value.weight", lp + "attention.self.value.bias")
            attn = self.attention(q, k, v, starts, starts, s.heads)
            a = self.linear(attn, lp + "attention.output.dense.weight", lp + "attention.output.dense.bias")
            x = self.norm(b.op("Add", a, x), lp + "attention.output.LayerNorm", s.eps)
            inter = self.act(self.linear(x, lp + "intermediate.dense.weight", lp + "intermediate.dense.bias"),
                             s.activation)
            o = self.linear(inter, lp + "output.dense.weight", lp + "output.dense.bias")
            x = self.norm(b.op("Add", o, x), lp + "output.LayerNorm", s.eps)
        return x

    # -- the Laya head ------------------------------------------------------------------------------

    def _head_ff(self, x: str, lp: str, at: str) -> str:
        ff = self.linear(self.norm(at, lp + "norm2", HEAD_EPS), lp + "linear1.weight", lp + "linear1.bias")
        return self.b.op("Add", at, self.linear(self.b.op("Relu", ff), lp + "linear2.weight", lp + "linear2.bias"))

    def build(self):
        """The main graph: packed rows in (`INPUTS`), marker logits and [CLS] head output out."""
        from onnx import TensorProto, helper

        self._start()
        b, s, d = self.b, self.spec, self.spec.hidden
        ids, positions, starts = "input_ids", "positions", "row_starts"
        h = (self.modernbert if s.arch == "modernbert" else self.bert)(ids, positions, starts)
        h = b.op("Add", h, b.op("Gather", self.param("type_emb.weight"), "token_qtype"))
        n_head = self.config.head_layers
        for i in range(max(0, n_head - 1)):
            lp = f"head.layers.{i}."
            a = self.norm(h, lp + "norm1", HEAD_EPS)
            q, k, v = (self.linear(a, lp + "self_attn.in_proj_weight", lp + "self_attn.in_proj_bias",
                                   rows=slice(j * d, (j + 1) * d)) for j in range(3))
            attn = self.attention(q, k, v, starts, starts, self.head_heads)
            h = b.op("Add", h, self.linear(attn, lp + "self_attn.out_proj.weight", lp + "self_attn.out_proj.bias"))
            h = self._head_ff(h, lp, h)
        picked = b.op("Gather", h, "select")
        if n_head:
            # The last head layer is read only at [CLS] and the markers: keys and values everywhere,
            # the rest at the selected tokens alone (as `LayaModel.infer`).
            lp = f"head.layers.{n_head - 1}."
            a = self.norm(h, lp + "norm1", HEAD_EPS)
            w, bias = lp + "self_attn.in_proj_weight", lp + "self_attn.in_proj_bias"
            k = self.linear(a, w, bias, rows=slice(d, 2 * d))
            v = self.linear(a, w, bias, rows=slice(2 * d, 3 * d))
            q = self.linear(b.op("Gather", a, "select"), w, bias, rows=slice(0, d))
            attn = self.attention(q, k, v, "select_starts", starts, self.head_heads)
            picked = b.op("Add", picked, self.linear(attn, lp + "self_attn.out_proj.weight",
                                                     lp + "self_attn.out_proj.bias"))
            picked = self._head_ff(picked, lp, picked)
        # The output layers stay fp32 at every precision: they are a sliver of the FLOPs.
        markers = b.op("Gather", picked, "marker_select")
        z = self.act(self.linear(self.norm(markers, "scorer.0", HEAD_EPS), "scorer.1.weight", "scorer.1.bias",
                                 quantize=False), "gelu")
        logits = b.op("Squeeze", self.linear(z, "scorer.3.weight", "scorer.3.bias", quantize=False),
                      b.const([1], np.int64))
        b.nodes.append(helper.make_node("Identity", [logits], ["logits"]))
        b.nodes.append(helper.make_node("Identity", [b.op("Gather", picked, "cls_select")], ["cls"]))
        inputs = [helper.make_tensor_value_info(n, TensorProto.INT64, [None]) for n in INPUTS]
        outputs = [helper.make_tensor_value_info("logits", TensorProto.FLOAT, [None]),
                   helper.make_tensor_value_info("cls", TensorProto.FLOAT, [None, d])]
        return _model(b, inputs, outputs)

    def build_act_head(self):
        """[CLS] output [R, d] and act features [R, 4] -> act logits [R, n_act] (always fp32)."""
        from onnx import TensorProto, helper

        self._start()
        b, d = self.b, self.spec.hidden
        x = b.op("Concat", "cls", "features", axis=-1)
        x = self.act(self.linear(x, "act_head.0.weight", "act_head.0.bias", quantize=False), "gelu")
        b.nodes.append(helper.make_node("Identity", [self.linear(x, "act_head.2.weight", "act_head.2.bias",
                                                                 quantize=False)], ["act"]))
        inputs = [helper.make_tensor_value_info("cls", TensorProto.FLOAT, [None, d]),
                  helper.make_tensor_value_info("features", TensorProto.FLOAT, [None, 4])]
        return _model(b, inputs, [helper.make_tensor_value_info("act", TensorProto.FLOAT, [None, None])])


def _model(b: _Builder, inputs: list, outputs: list):
    """The ModelProto, and the arrays computed here that onnxruntime takes in memory.

    Checkpoint tensors are declared as external data at their place in `model.safetensors`, so
    onnxruntime reads them itself (no copy in Python, none in the protobuf) and frees what it folds or
    prepacks. Computed arrays are declared the same way but handed over with
    `SessionOptions.add_initializer`, which takes precedence over the declaration when the session runs;
    constant folding, though, reads declarations. So no node may take a computed array as its only
    input: such values are computed here in numpy instead (e.g. BERT's token-type row)."""
    from onnx import helper

    declared = list(b.declared)
    for name, a in b.weights.items():
        declared.append(_external(name, _onnx_type(a), a.shape, 0, a.nbytes))
    graph = helper.make_graph(b.nodes, "laya", inputs, outputs, b.constants + declared)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", OPSET), helper.make_opsetid(MS_DOMAIN, 1)])
    model.ir_version = 10
    return model, dict(b.weights)


def _external(name: str, onnx_type: int, shape: tuple[int, ...], offset: int, length: int):
    from onnx import TensorProto

    t = TensorProto(name=name, data_type=onnx_type, dims=list(shape))
    t.data_location = TensorProto.EXTERNAL
    for key, value in (("location", EXTERNAL_FILE), ("offset", str(offset)), ("length", str(length))):
        entry = t.external_data.add()
        entry.key, entry.value = key, value
    return t


def _onnx_type(a: np.ndarray) -> int:
    from onnx import helper

    return helper.np_dtype_to_tensor_dtype(a.dtype)
