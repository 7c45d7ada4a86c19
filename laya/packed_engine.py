"""bf16 decisions on CPU: the Laya model over packed rows in torch, from the checkpoint's weights.

Why not `LayaModel` under autocast (what `laya.torch_engine` does, and what a GPU still runs): on CPU
that path ran one padded row per forward (oneDNN's kernels had to see fixed shapes), re-read every
weight once per row and spent a third of its time outside the matmuls (autocast copies, padding,
transformers' per-call bookkeeping). Here, as in `laya.onnx_graph`, every row of a call is packed into
one token axis without padding, so each weight is one bf16 GEMM over all tokens at once (weights are
converted to bf16 once, at load), attention runs row by row over exactly that row's tokens, and every
other op works token by token.

Why a row's bits cannot depend on its batch mates: every bf16 GEMM call has a row count M at which this
machine's GEMM was measured, in this process, to give each row the bits a call of 64 rows gives it,
wherever the row sits (`Bf16Linear.rows_ok`: 64 itself at load, other counts at first use); calls are
padded up to such a count or cut into such blocks. oneDNN picks its kernel and its K blocking by M: on
an AMX CPU a row's result differed between M = 16, 57, 170 and 1,000 (up to 0.04 in a logit), so M
cannot simply follow the call's token count. Layer norms and activations are per token, and attention
never sees another row. What stays fp32: the residual stream, layer norms, rotary embeddings,
attention, and the output layers (scorer, act head), which are a sliver of the FLOPs. What is bf16:
the inputs and outputs of the large linears, i.e. almost all of the arithmetic.

Why the feed-forward activations run inside the GEMMs (oneDNN post-ops: the activation, and GeGLU's
gate product, applied to the fp32 accumulator before the one rounding to bf16): the MLP's
intermediate is the widest tensor of a layer, and on a CPU whose single core streams memory slowly
(the Intel AMX machine of docs/benchmarks.md) widening it to fp32, activating, multiplying and
narrowing it again cost almost as much as its GEMM. Fused, it is written once, in bf16, and read
once, by the next GEMM; one rounding fewer, too.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from functools import lru_cache
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

from laya import kernels
from laya.config import LayaConfig
from laya.engine import HEAD_DIM, RowOutput, act_features, softmax
from laya.layout import check_shapes
from laya.onnx_graph import HEAD_EPS, EncoderSpec, LayaGraph, Unsupported
from laya.packing import MAX_TOKENS, Packed, pack, token_chunks
from laya.precision import Plan
from laya.rows import Row
from laya.weights import SafeTensors

_ACT = {"gelu": F.gelu, "gelu_tanh": lambda x: F.gelu(x, approximate="tanh"), "relu": F.relu, "silu": F.silu}
# The same activations as oneDNN post-ops: (attr, algorithm) of `mkldnn._linear_pointwise`.
_POST_OP = {"gelu": ("gelu", "none"), "gelu_tanh": ("gelu", "tanh"), "relu": ("relu", ""), "silu": ("swish", "")}


class PackedEngine:
    def __init__(self, encoder_config: dict[str, Any], config: LayaConfig, weights_path: str, plan: Plan,
                 threads: int | None = None):
        started = time.perf_counter()
        self.plan = plan
        self.config = config
        self.spec = EncoderSpec.from_config(encoder_config)    # raises Unsupported for other encoders
        self.weights = SafeTensors(weights_path)
        check_shapes(LayaGraph(self.weights, self.spec, config).tensor_shapes(),
                     {n: self.weights.shape(n) for n in self.weights}, weights_path)
        if threads:
            torch.set_num_threads(threads)
        self.threads = torch.get_num_threads()
        self.chunk_tokens = run_tokens(self.spec.hidden)
        self.head_heads = max(1, self.spec.hidden // HEAD_DIM)
        # Attention (with rotary), residual adds with norms and the output linears as compiled kernels where this
        # machine can build them (`laya.kernels`) and they are built for the head sizes.
        self.fused = kernels.available() and all(
            kernels.supports(self.spec.hidden // h) for h in (self.spec.heads, self.head_heads))
        self._load()
        self.weights.release()
        self.load_s = time.perf_counter() - started

    # -- weights ------------------------------------------------------------------------------------

    def _f32(self, name: str) -> torch.Tensor:
        return torch.from_numpy(np.array(self.weights.float32(name), dtype=np.float32))

    def _linear(self, weights: list[str], biases: list[str] | None = None, enabled: bool = True,
                rows: slice | torch.Tensor | None = None, activation: str | None = None,
                product: bool = False) -> Bf16Linear:
        """One bf16 linear from checkpoint weights [out, in], several stacked along `out` (q, k and v as one
        GEMM); `rows` takes a range (or a reordering) of the outputs; biases only if `enabled` and stored."""
        w = torch.cat([self._f32(n) for n in weights])
        b = None
        if biases and enabled and all(n in self.weights for n in biases):
            b = torch.cat([self._f32(n) for n in biases])
        if rows is not None:
            w, b = w[rows], (b[rows] if b is not None else None)
        return Bf16Linear(w, b, activation, product)

    def _load(self) -> None:
        s, p = self.spec, "encoder."
        L = self._linear
        self.layers: list[dict[str, Any]] = []
        if s.arch == "modernbert":
            e = p + "embeddings."
            stored = self.weights.dtype(e + "tok_embeddings.weight")
            self.tok_emb = self._f32(e + "tok_embeddings.weight").to(torch.float16 if stored == "F16" else torch.float32)
            self.emb_norm = self._norm_params(e + "norm", s.norm_bias)
            # Rotary as one complex product: cos + i sin per position and frequency.
            self.rope = {t: torch.complex(*(torch.from_numpy(a) for a in s.rope_tables(s.rope_theta[t])))
                         for t in set(s.layer_types)}
            qkv_rows = _interleave_rotary_pairs(s.hidden, s.heads)
            inp, gate = slice(0, s.intermediate), slice(s.intermediate, 2 * s.intermediate)
            for i, t in enumerate(s.layer_types):
                lp = f"{p}layers.{i}."
                wi = [lp + "mlp.Wi.weight"], [lp + "mlp.Wi.bias"], s.mlp_bias
                self.layers.append({
                    "type": t, "attn_norm": self._norm_params(lp + "attn_norm", s.norm_bias) if i else None,
                    "qkv": L([lp + "attn.Wqkv.weight"], [lp + "attn.Wqkv.bias"], s.attention_bias, rows=qkv_rows),
                    "out": L([lp + "attn.Wo.weight"], [lp + "attn.Wo.bias"], s.attention_bias),
                    "mlp_norm": self._norm_params(lp + "mlp_norm", s.norm_bias),
                    # GeGLU as two GEMMs: act(x Wi_in) in one, times (x Wi_gate) in the other's post-op.
                    "wi_act": L(*wi, rows=inp, activation=s.activation), "wi_gate": L(*wi, rows=gate, product=True),
                    "wo": L([lp + "mlp.Wo.weight"], [lp + "mlp.Wo.bias"], s.mlp_bias)})
            self.final_norm = self._norm_params(p + "final_norm", s.norm_bias)
        else:
            e = p + "embeddings."
            self.word_emb = self._f32(e + "word_embeddings.weight")
            self.pos_emb = self._f32(e + "position_embeddings.weight")
            self.type_row = self._f32(e + "token_type_embeddings.weight")[0]
            self.emb_norm = self._norm_params(e + "LayerNorm")
            for i in range(s.layers):
                lp = f"{p}encoder.layer.{i}."
                qkv = [lp + f"attention.self.{n}" for n in ("query", "key", "value")]
                self.layers.append({
                    "qkv": L([n + ".weight" for n in qkv], [n + ".bias" for n in qkv]),
                    "out": L([lp + "attention.output.dense.weight"], [lp + "attention.output.dense.bias"]),
                    "norm1": self._norm_params(lp + "attention.output.LayerNorm"),
                    "wi": L([lp + "intermediate.dense.weight"], [lp + "intermediate.dense.bias"],
                            activation=s.activation),
                    "wo": L([lp + "output.dense.weight"], [lp + "output.dense.bias"]),
                    "norm2": self._norm_params(lp + "output.LayerNorm")})
        self.type_emb = self._f32("type_emb.weight")
        d = s.hidden
        self.head: list[dict[str, Any]] = []
        for i in range(self.config.head_layers):
            lp = f"head.layers.{i}."
            w_in, b_in = [lp + "self_attn.in_proj_weight"], [lp + "self_attn.in_proj_bias"]
            last = i == self.config.head_layers - 1      # read at [CLS] and the markers only: q apart from k, v
            projections = ({"q": L(w_in, b_in, rows=slice(0, d)), "kv": L(w_in, b_in, rows=slice(d, 3 * d))} if last
                           else {"qkv": L(w_in, b_in)})
            self.head.append({
                "norm1": self._norm_params(lp + "norm1"), **projections,
                "out": L([lp + "self_attn.out_proj.weight"], [lp + "self_attn.out_proj.bias"]),
                "norm2": self._norm_params(lp + "norm2"),
                "w1": L([lp + "linear1.weight"], [lp + "linear1.bias"], activation="relu"),
                "w2": L([lp + "linear2.weight"], [lp + "linear2.bias"])})
        self.scorer = [self._f32(n) for n in ("scorer.0.weight", "scorer.0.bias", "scorer.1.weight", "scorer.1.bias",
                                              "scorer.3.weight", "scorer.3.bias")]
        self.act_head = [self._f32(n) for n in ("act_head.0.weight", "act_head.0.bias", "act_head.2.weight",
                                                "act_head.2.bias")]

    def _stream_rows_ok(self, rows: int) -> bool:
        return all(linear.rows_ok(rows) for linear in self.layers[-1].values() if isinstance(linear, Bf16Linear))

    def _norm_params(self, prefix: str, bias: bool = True) -> tuple[torch.Tensor, torch.Tensor | None]:
        return self._f32(prefix + ".weight"), (self._f32(prefix + ".bias") if bias and prefix + ".bias" in self.weights
                                               else None)

    def describe(self) -> dict:
        return {**self.plan.summary(), "threads": self.threads, "load_s": round(self.load_s, 2),
                "tokens_per_run": self.chunk_tokens, "rows_per_forward": "packed",
                "gemm_rows": f"{MIN_ROWS}-{MAX_ROWS} per call, each count checked at first use to give a row the "
                             f"bits of a {MIN_ROWS}-row call",
                "bf16": {"linears": "bf16 weights and inputs (oneDNN), feed-forward activations fused into their GEMMs",
                         "fp32": "residual stream, norms, attention, scorer and act head"},
                "attention": "compiled kernels (laya.kernels)" if self.fused else
                             f"torch ops ({kernels.unavailable_reason() or 'a head size the kernels are not built for'})"}

    # -- forward ------------------------------------------------------------------------------------

    @torch.inference_mode()
    def forward(self, rows: list[Row]) -> list[RowOutput]:
        return [out for chunk in token_chunks(rows, self.chunk_tokens) for out in self._run(pack(chunk))]

    def _run(self, b: Packed) -> list[RowOutput]:
        # The token axis is padded once to what the encoder's GEMMs may be called with (see `Bf16Linear`),
        # so none of them copies its input to pad it; no row attends to the padding.
        size, calls = row_blocks(len(b.input_ids), self._stream_rows_ok)
        ids, positions, qtype = (F.pad(torch.from_numpy(a), (0, size * calls - len(a)))
                                 for a in (b.input_ids, b.positions, b.token_qtype))
        starts = b.row_starts.tolist()
        h = self._modernbert(ids, positions, starts) if self.spec.arch == "modernbert" else self._bert(ids, positions, starts)
        h = h + self.type_emb[qtype]
        d = self.spec.hidden
        for layer in self.head[:-1]:
            a = self._norm_bf16(h, layer["norm1"], HEAD_EPS)
            h, a = self._residual_norm(h, layer["out"], self._self_attention(layer["qkv"], a, self.head_heads, starts),
                                       layer["norm2"], HEAD_EPS)
            h = layer["w2"](layer["w1"].bf16(a), residual=h)
        select = torch.from_numpy(b.select)
        picked = h[select]
        if self.head:
            # The last head layer is read only at [CLS] and the markers (as `LayaModel.infer`).
            last = self.head[-1]
            a = self._norm_bf16(h, last["norm1"], HEAD_EPS)
            if self.fused:
                attn = kernels.attention(last["q"].bf16(a[select]), self.head_heads,
                                         torch.from_numpy(b.select_starts.astype(np.int32)), kv=last["kv"].bf16(a),
                                         kv_starts=torch.tensor(starts, dtype=torch.int32))
            else:
                k, v = (_heads(t, self.head_heads) for t in last["kv"](a).split(d, -1))
                attn = _attention(_heads(last["q"](a[select]), self.head_heads), k, v, b.select_starts.tolist(), starts)
            picked = last["out"](attn, residual=picked)
            picked = last["w2"](last["w1"].bf16(self._norm_bf16(picked, last["norm2"], HEAD_EPS)), residual=picked)
        n0, b0, w1, b1, w3, b3 = self.scorer
        markers = picked[torch.from_numpy(b.marker_select)]
        z = F.gelu(_fp32_rows(_norm(markers, (n0, b0), HEAD_EPS), w1, b1))
        logits = _fp32_rows(z, w3, b3)[:, 0].numpy()
        cls = picked[torch.from_numpy(b.cls_select)]
        bounds = np.cumsum([0] + b.marker_counts)
        per_row = [logits[bounds[i]:bounds[i + 1]].copy() for i in range(len(b.marker_counts))]
        features = torch.from_numpy(np.stack([act_features(lg) for lg in per_row]))
        a0, ab0, a2, ab2 = self.act_head
        act = _fp32_rows(F.gelu(_fp32_rows(torch.cat([cls, features], -1), a0, ab0)), a2, ab2).numpy()
        return [RowOutput(lg, softmax(a)) for lg, a in zip(per_row, act)]

    def _norm_bf16(self, x: torch.Tensor, wb: tuple[torch.Tensor, torch.Tensor | None], eps: float) -> torch.Tensor:
        """A layer norm whose only reader is a bf16 GEMM, rounded to bf16 as it is computed where the kernels run."""
        if self.fused and x.size(-1) % 16 == 0:
            return kernels.layer_norm_bf16(x, wb[0], wb[1], eps)[0]
        return _norm(x, wb, eps).to(torch.bfloat16)

    def _residual_norm(self, x: torch.Tensor, linear: Bf16Linear, inp: torch.Tensor,
                       wb: tuple[torch.Tensor, torch.Tensor | None], eps: float) -> tuple[torch.Tensor, torch.Tensor]:
        """(x + linear(inp), its layer norm in bf16): the residual stream's next value and the next GEMM's input,
        in one pass where the kernels run (the same bits for the sum as `linear(inp, residual=x)`: on oneDNN the
        GEMM's bf16 output is what both add)."""
        if self.fused and linear.packed is not None and x.size(-1) % 16 == 0:
            a, x = kernels.layer_norm_bf16(x, wb[0], wb[1], eps, add=linear.bf16(inp))
            return x, a
        x = linear(inp, residual=x)
        return x, self._norm_bf16(x, wb, eps)

    def _self_attention(self, qkv: Bf16Linear, x: torch.Tensor, heads: int, starts: list[int],
                        rope: torch.Tensor | None = None, window: int | None = None) -> torch.Tensor:
        """Each row's self-attention over the q|k|v linear of x (q and k rotated by `rope` when given): the
        compiled kernel's bf16 result, or the torch ops' fp32 one."""
        if self.fused:
            return kernels.attention(qkv.bf16(x), heads, torch.tensor(starts, dtype=torch.int32), rope=rope,
                                     window=window)
        y = qkv(x)
        d = y.size(1) // 3
        if rope is None:
            q, k = _heads(y[:, :d], heads), _heads(y[:, d:2 * d], heads)
        else:
            q, k = _rotary(y[:, :2 * d], rope, heads)
        return _attention(q, k, _heads(y[:, 2 * d:], heads), starts, starts, window)

    def _modernbert(self, ids: torch.Tensor, positions: torch.Tensor, starts: list[int]) -> torch.Tensor:
        s = self.spec
        x = _norm(self.tok_emb[ids].float(), self.emb_norm, s.eps)
        rope = {t: table[positions] for t, table in self.rope.items()}
        mlp_out: tuple[Bf16Linear, torch.Tensor] | None = None    # the last layer's, added with the next norm
        for layer in self.layers:
            if layer["attn_norm"] is None:      # the first layer reads the embeddings as they are
                a = x
            else:
                x, a = self._residual_norm(x, *mlp_out, layer["attn_norm"], s.eps)
            window = s.window if layer["type"] == "sliding_attention" else None
            attn = self._self_attention(layer["qkv"], a, s.heads, starts, rope[layer["type"]], window)
            x, a = self._residual_norm(x, layer["out"], attn, layer["mlp_norm"], s.eps)
            mlp_out = layer["wo"], layer["wi_gate"].bf16(a, times=layer["wi_act"].bf16(a))
        x = mlp_out[0](mlp_out[1], residual=x)
        return _norm(x, self.final_norm, s.eps)

    def _bert(self, ids: torch.Tensor, positions: torch.Tensor, starts: list[int]) -> torch.Tensor:
        s = self.spec
        x = _norm(self.word_emb[ids] + self.type_row + self.pos_emb[positions], self.emb_norm, s.eps)
        for layer in self.layers:
            x = _norm(layer["out"](self._self_attention(layer["qkv"], x, s.heads, starts), residual=x), layer["norm1"],
                      s.eps)
            x = _norm(layer["wo"](layer["wi"].bf16(x), residual=x), layer["norm2"], s.eps)
        return x


class Bf16Linear:
    """x @ W.T (+ b) with bf16 inputs and weights, the bias added to the fp32 accumulator: `linear(x)` gives
    the result widened to fp32, `linear(x, residual=r)` r + it in one pass (the fp32 residual stream);
    `linear.bf16(x)` the bf16 input of the next linear, with `activation` (or, for a `product` linear, the
    product with `times`) applied to the accumulator before its one rounding.

    Every GEMM call has a row count at which this machine's GEMM was measured to give each row the bits it
    gets in a call of MIN_ROWS rows (`rows_ok`): a call of other sizes is padded up, or cut into such
    blocks. If even the reference call rounds a row by its place: `Unsupported`.

    The weight is reordered once, at load, into oneDNN's blocked layout when this torch can
    (`mkldnn._reorder_linear_weight`: 5-15% faster GEMMs at 64-512 rows on a Zen 5, and the same bits
    as the plain call, which the tests check); a CPU whose oneDNN has no bf16 kernels keeps the
    plain matrix, F.linear, and the activation and product as separate fp32 ops."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, activation: str | None = None,
                 product: bool = False):
        if activation is not None and product:
            raise ValueError("oneDNN takes one post-op here: an activation or a product")
        weight = weight.to(torch.bfloat16).contiguous()
        self.out_features, self.in_features = weight.shape
        self.bias = bias
        self.bias_bf16 = None if bias is None else bias.to(torch.bfloat16)   # the product post-op takes its input's type
        self.activation = activation
        self.product = product
        self.weight, self.packed = (None, torch.ops.mkldnn._reorder_linear_weight(weight, PREPACK_ROWS)) \
            if _can_prepack() else (weight, None)
        # What the GEMM's kernel choice depends on besides the row count (and the thread count, read per call).
        self.signature = (self.in_features, self.out_features, bias is not None, activation, product,
                          self.packed is not None)
        self._block_cache: dict[tuple[int, int], list[tuple[int, int, int]]] = {}
        if not self.rows_ok(MIN_ROWS):
            raise Unsupported(f"this CPU's bf16 GEMM ({self.in_features} -> {self.out_features}) rounds a row "
                              "differently by its place in the matrix")

    def __call__(self, x: torch.Tensor, residual: torch.Tensor | None = None) -> torch.Tensor:
        x = x.to(torch.bfloat16)
        blocks = self._blocks(x.size(0))
        if len(blocks) == 1 and blocks[0][2] == x.size(0):     # one call as it stands (slices cost ~5% here)
            y = self._gemm(x)
            if residual is None:
                return y.float()
            if y.dtype == torch.bfloat16 and kernels.available():
                return kernels.add_widened(residual, y)
            return torch.add(residual, y)
        out = torch.empty(x.size(0), self.out_features)
        for start, stop, rows in blocks:
            y = self._gemm(_pad_rows(x[start:stop], rows))[:stop - start]
            if residual is None:
                out[start:stop].copy_(y)
            else:
                torch.add(residual[start:stop], y, out=out[start:stop])
        return out

    def bf16(self, x: torch.Tensor, times: torch.Tensor | None = None) -> torch.Tensor:
        assert (times is not None) == self.product, "a product linear takes `times`, no other does"
        x = x.to(torch.bfloat16)
        times = None if times is None else times.to(torch.bfloat16)
        blocks = self._blocks(x.size(0))
        if len(blocks) == 1 and blocks[0][2] == x.size(0):
            return self._gemm(x, times, narrow=True)
        parts = [self._gemm(_pad_rows(x[start:stop], rows),
                            None if times is None else _pad_rows(times[start:stop], rows), narrow=True)[:stop - start]
                 for start, stop, rows in blocks]
        if not parts:
            return x.new_zeros((0, self.out_features))
        return parts[0] if len(parts) == 1 else torch.cat(parts)

    def rows_ok(self, rows: int) -> bool:
        """Whether a call of `rows` rows gives every row the bits it gets in a call of MIN_ROWS rows (for
        the reference count itself: whatever its place in the call). Measured once per process for each
        signature, thread count and row count, on this linear's weights and random rows: oneDNN chooses its
        kernel and K blocking by the row count, threads and CPU (on an AMX CPU a K = 3,072 GEMM disagrees
        with the 64-row calls at 170 rows and at most counts above 160), so no count is assumed safe."""
        key = (*self.signature, torch.get_num_threads(), rows)
        if key not in _ROWS_OK:     # every other count is compared with the reference: it must hold first
            _ROWS_OK[key] = (rows == MIN_ROWS or self.rows_ok(MIN_ROWS)) and self._measure_rows(rows)
        return _ROWS_OK[key]

    def _measure_rows(self, rows: int) -> bool:
        base = MIN_ROWS
        n = -(-max(rows, base + base // 2) // base) * base            # whole reference calls
        g = torch.Generator().manual_seed(0)
        x = torch.randn(n, self.in_features, generator=g).bfloat16()
        t = torch.randn(n, self.out_features, generator=g).bfloat16() if self.product else None
        narrow = self.activation is not None or self.product

        def run(start: int, stop: int) -> torch.Tensor:
            return self._gemm(x[start:stop], None if t is None else t[start:stop], narrow)

        reference = torch.cat([run(start, start + base) for start in range(0, n, base)])
        if rows == base:                                             # the same rows, another place in the call
            return torch.equal(run(base // 2, base // 2 + base), reference[base // 2:base // 2 + base])
        return torch.equal(run(0, rows), reference[:rows])

    def _blocks(self, n: int) -> list[tuple[int, int, int]]:
        """(start, stop, rows of the call) covering n rows (the last call padded up to its rows). Kept per row
        and thread count: `row_blocks` and its checks cost ~10 us a call in Python, ~1 ms of a base predict. The
        cache stays small: a call has at most a run's tokens (`run_tokens`), or one long row's, up to the model's
        length."""
        key = (n, torch.get_num_threads())
        blocks = self._block_cache.get(key)
        if blocks is None:
            size = row_blocks(n, self.rows_ok)[0] if n else 0
            blocks = self._block_cache[key] = [(start, min(start + size, n), size) for start in range(0, n, size or 1)]
        return blocks

    def _gemm(self, x: torch.Tensor, times: torch.Tensor | None = None, narrow: bool = False) -> torch.Tensor:
        """One GEMM call on bf16 `x`: fp32 out (bias only), or with `narrow` the post-op's bf16 out."""
        if self.packed is None:
            y = F.linear(x, self.weight).float()
            y = y if self.bias is None else y + self.bias
            if not narrow:
                return y
            y = y if self.activation is None else _ACT[self.activation](y)
            return (y if times is None else y * times.float()).to(torch.bfloat16)
        if times is not None:
            return torch.ops.mkldnn._linear_pointwise.binary(x, times, self.packed, self.bias_bf16, "mul")
        attr, algorithm = _POST_OP[self.activation] if narrow and self.activation else ("none", "")
        return torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, attr, [], algorithm)


# A bf16 GEMM call has MIN_ROWS to MAX_ROWS rows; MIN_ROWS is the reference every other count is checked
# against (fewer rows are padded up to it: oneDNN runs other kernels below it).
MIN_ROWS, MAX_ROWS = 64, 512
_ROWS_OK: dict[tuple, bool] = {}     # (signature, threads, rows) -> measured once per process


def row_blocks(n: int, ok: Callable[[int], bool]) -> tuple[int, int]:
    """(rows per call, calls) for n > 0 rows: as few calls as MAX_ROWS allows, each of the fewest rows that many
    calls need if `ok` accepts that count, else of the next multiple of 32 it accepts, else one call more.
    Ends: `ok(MIN_ROWS)` holds for every linear the engine built."""
    calls = -(-n // MAX_ROWS)
    while True:
        need = max(MIN_ROWS, -(-n // calls))
        for count in (need, *range(-(-need // 32) * 32, MAX_ROWS + 1, 32)):
            if ok(count):
                return count, calls
        calls += 1


def _pad_rows(x: torch.Tensor, rows: int) -> torch.Tensor:
    return x if x.size(0) == rows else F.pad(x, (0, 0, 0, rows - x.size(0)))


PREPACK_ROWS = 512     # the row count oneDNN's weight layout is chosen for; any count runs on it
# The most bytes one fp32 [tokens, hidden] activation of a run may take (`run_tokens`).
RUN_BYTES = 3 << 19


def run_tokens(hidden: int) -> int:
    """Tokens per run: as many as keep one fp32 [tokens, hidden] activation within RUN_BYTES (512 at d=768), whatever
    the thread count. Why not onnxruntime's budget of 512 tokens per thread: here every norm, cast, residual add and
    attention copy is its own pass over such tensors, and once they outgrow the core's cache those passes cost more
    than bigger GEMM calls save. Measured on an Intel AMX CPU (2 MiB L2 per core, docs/benchmarks.md): 16 requests'
    rows at base size ran 1.17x faster than one request at a time at 384-512 tokens per run and 1.06x at 1,024, at 1 and
    2 threads alike; at laya-mini's d=384, 512 and 1,024 tied (1,024 a hair ahead) and 2,048 was slower, at both."""
    return min(MAX_TOKENS, max(MIN_ROWS, RUN_BYTES // (4 * hidden) // MIN_ROWS * MIN_ROWS))


@lru_cache(maxsize=1)
def _can_prepack() -> bool:
    """Whether this torch's oneDNN runs every call `Bf16Linear` makes on prepacked weights: the plain GEMM
    with an fp32 bias, an activation post-op and the product post-op (all or none, so an engine never mixes
    the two paths' roundings)."""
    try:
        w = torch.ones(16, 16, dtype=torch.bfloat16)
        x = torch.ones(2, 16, dtype=torch.bfloat16)
        packed = torch.ops.mkldnn._reorder_linear_weight(w, PREPACK_ROWS)
        y = torch.ops.mkldnn._linear_pointwise(x, packed, torch.zeros(16), "none", [], "")
        g = torch.ops.mkldnn._linear_pointwise(x, packed, None, "relu", [], "")
        m = torch.ops.mkldnn._linear_pointwise.binary(x, g, packed, None, "mul")
        return bool((y == 16).all() and (m == 256).all())
    except (RuntimeError, AttributeError):
        return False


def _fp32_rows(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """A small fp32 linear whose rows cannot depend on each other: a BLAS may pick its GEMM kernel (and so its
    rounding) by the row count. The compiled kernel reads the weight once for all rows; without it, one
    matrix-vector product per row."""
    if kernels.available():
        return kernels.rows_linear(x, w, b)
    return torch.stack([torch.mv(w, row) for row in x]) + b if len(x) else x.new_zeros((0, w.size(0)))


def _norm(x: torch.Tensor, wb: tuple[torch.Tensor, torch.Tensor | None], eps: float) -> torch.Tensor:
    return F.layer_norm(x, (x.size(-1),), wb[0], wb[1], eps)


def _interleave_rotary_pairs(hidden: int, heads: int) -> torch.Tensor:
    """The order of Wqkv's output rows that puts each head's rotate-half pairs (dims j and j + hd/2) side by
    side in q and k (v as stored). Attention's q.k sums over a head's dims in any order alike, and rotary
    on adjacent pairs is one complex product (`_rotary`) instead of halves, cats and four products."""
    hd = hidden // heads
    pairs = torch.arange(hd).view(2, hd // 2).t().reshape(-1)          # 0, hd/2, 1, hd/2 + 1, ...
    per_head = (torch.arange(2 * heads)[:, None] * hd + pairs).reshape(-1)
    return torch.cat([per_head, torch.arange(2 * hidden, 3 * hidden)])


def _rotary(qk: torch.Tensor, rope: torch.Tensor, heads: int) -> tuple[torch.Tensor, torch.Tensor]:
    """q and k ([T, 2 * heads * hd], pairs interleaved) rotated by each token's own position (`rope` [T, hd / 2],
    complex), written head-major: two [heads, T, hd] tensors."""
    t = torch.view_as_complex(qk.unflatten(-1, (2 * heads, -1, 2)))
    out = torch.empty(t.size(1), t.size(0), t.size(2), dtype=t.dtype)
    torch.mul(t.transpose(0, 1), rope[None], out=out)
    rotated = torch.view_as_real(out).flatten(-2)
    return rotated[:heads], rotated[heads:]


def _heads(x: torch.Tensor, heads: int) -> torch.Tensor:
    """[T, heads * hd] as a head-major view [heads, T, hd] (no copy)."""
    return x.unflatten(-1, (heads, -1)).transpose(0, 1)


def _attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_starts: list[int], kv_starts: list[int],
               window: int | None = None) -> torch.Tensor:
    """softmax(q k^T / sqrt(hd)) v row by row, fp32, on head-major [heads, T, hd] inputs: row r's queries
    q[:, q_starts[r]:q_starts[r+1]] attend to its own keys k[:, kv_starts[r]:kv_starts[r+1]]; `window`: only
    |i - j| <= window (queries and keys of one row). Returns [T, heads * hd]. Written out (two bmm and a
    softmax) rather than through SDPA, whose CPU kernels take 4-D inputs only and whose fallback spent ~40%
    more time per row on mask checks at these sizes."""
    heads, scale = q.size(0), q.size(-1) ** -0.5
    out = torch.empty(q.size(1), heads, v.size(-1))
    for r in range(len(q_starts) - 1):
        qs, ks = slice(q_starts[r], q_starts[r + 1]), slice(kv_starts[r], kv_starts[r + 1])
        scores = torch.bmm(q[:, qs], k[:, ks].transpose(1, 2)).mul_(scale)
        n = scores.size(-1)
        if window is not None and n > window + 1:
            idx = torch.arange(n)
            scores.masked_fill_((idx[:, None] - idx[None, :]).abs() > window, float("-inf"))
        out[qs].copy_(torch.bmm(torch.softmax(scores, -1), v[:, ks]).transpose(0, 1))
    out[q_starts[-1]:] = 0                         # padding tokens, in no row
    return out.flatten(1)
