"""ONNX export of the encoder student (fp32 and dynamic int8) with a check against torch.

The check is what makes the export trustworthy: ONNX Runtime must reproduce the torch student's
logits within `export.tolerance` on held rows (padded batches included, so the mask is exercised),
and the int8 model's calibrated probabilities must stay within `export.int8_tolerance` of fp32.
Both maxima are printed and written to student.json; past a tolerance the export fails.
"""

from __future__ import annotations

import os
import warnings
from pathlib import Path

import numpy as np
import torch

from distill.modeling_student import EncoderStudent, pad
from laya.calibration import softmax

OPSET = 17


def export_fp32(model: EncoderStudent, path: Path) -> None:
    model.eval()
    # Trace with padding present so nothing mask-related can be constant-folded away.
    ids, mask = pad([[101, 2000, 2001, 2002, 102], [101, 2003, 102]])
    tmp = path.with_suffix(".tmp.onnx")
    with warnings.catch_warnings(), torch.no_grad():
        warnings.simplefilter("ignore")
        torch.onnx.export(model, (ids, mask), str(tmp), input_names=["input_ids", "attention_mask"],
                          output_names=["logits"], opset_version=OPSET, dynamo=False,
                          dynamic_axes={"input_ids": {0: "batch", 1: "tokens"},
                                        "attention_mask": {0: "batch", 1: "tokens"}, "logits": {0: "batch"}})
    os.replace(tmp, path)


class ExportCheckError(RuntimeError):
    """An exported model differs from its source past the task's tolerance: the export is not written."""


def quantize_int8(src: Path, dst: Path, activations: str | None = None) -> None:
    """The int8 student: embeddings by onnxruntime's dynamic quantiser, every linear by `_per_token_linears`
    (`activations` per-tensor: the linears by onnxruntime's dynamic quantiser as well; default per-token).

    Why not `quantize_dynamic` for the linears by default: it gives all tokens of a call one activation
    scale, so a few large-norm tokens ([CLS], [SEP], punctuation) coarsen everyone else's. On the
    support-triage student that cost max |int8 - fp32| p 0.20-0.28; per-token activations bring it
    to 0.03-0.07, at about 1.4x the time (docs/distill.md). onnxruntime's quantiser has no per-token
    mode, and its MatMulNBits 8-bit path was as accurate but slower, hence the rewrite.
    """
    import onnx
    from onnxruntime.quantization import QuantType, quantize_dynamic

    from distill.task import INT8_ACTIVATIONS, PER_TOKEN

    activations = activations or PER_TOKEN
    if activations not in INT8_ACTIVATIONS:
        raise ValueError(f"export.int8_activations: must be one of {list(INT8_ACTIVATIONS)}, got {activations!r}")
    tmp = dst.with_suffix(".tmp.onnx")
    ops = ["Gather"] if activations == PER_TOKEN else ["MatMul", "Gather"]
    quantize_dynamic(str(src), str(tmp), weight_type=QuantType.QInt8, per_channel=True, op_types_to_quantize=ops)
    if activations == PER_TOKEN:
        model = onnx.load(str(tmp))
        _per_token_linears(model)
        onnx.save(model, str(tmp))
    os.replace(tmp, dst)


def _per_token_linears(model) -> None:
    """Swap each `MatMul(x, W)` with a constant 2-D W for asymmetric per-token uint8 x times per-channel W.

    A token's scale and zero point are its own (min/max over its features, with 0 in range), so the
    one-sided GELU outputs feeding `down` get all 256 levels, and a token's int8 values do not depend
    on what else shares the call. W is symmetric per output channel (|q| <= 127) stored as uint8 with
    zero point 128: onnxruntime's u8*u8 kernel accumulates exactly on every x86 CPU, where u8*s8
    saturates 16-bit pair sums on AVX2 without VNNI (measured: worse agreement). The zero point of x is
    taken out afterwards as `step * zp * scale * colsum(q)`: the op's own `a_zero_point` is per tensor.
    The rounding itself is one `QuantizeLinear` over a [tokens, features] view with a per-row scale and
    zero point: the same bits as dividing, rounding, shifting, clipping and casting op by op (a test checks
    it against that chain) in one pass: the graph 5% faster, a `Student` call 2.5% (measured, docs/distill.md).
    """
    from onnx import TensorProto, helper, numpy_helper

    g = model.graph
    weights = {t.name: t for t in g.initializer}

    def const(name: str, value) -> str:
        g.initializer.append(numpy_helper.from_array(np.asarray(value), name))
        return name

    zero, inv, tiny = (const("q8.zero", np.float32(0)), const("q8.inv255", np.float32(1 / 255)),
                       const("q8.tiny", np.float32(1e-30)))
    one, w_zero = const("q8.one", np.float32(1)), const("q8.w_zero", np.uint8(128))
    column = const("q8.column", np.array([-1], np.int64))
    nodes, quantized = [], {}
    for node in g.node:
        w_name = node.input[1] if node.op_type == "MatMul" else None
        if w_name not in weights or len(weights[w_name].dims) != 2:
            nodes.append(node)
            continue
        x = node.input[0]
        w = numpy_helper.to_array(weights[w_name]).astype(np.float32)          # [in, out]
        if x not in quantized:   # q, k and v share one quantised input
            p = f"q8.x{len(quantized)}"
            rows = const(p + ".rows", np.array([-1, w.shape[0]], np.int64))
            steps = [("ReduceMax", [x], "hi0", {"axes": [-1], "keepdims": 1}),
                     ("ReduceMin", [x], "lo0", {"axes": [-1], "keepdims": 1}),
                     ("Max", [p + ".hi0", zero], "hi", {}), ("Min", [p + ".lo0", zero], "lo", {}),
                     ("Sub", [p + ".hi", p + ".lo"], "range", {}), ("Mul", [p + ".range", inv], "step0", {}),
                     ("Max", [p + ".step0", tiny], "step", {}), ("Div", [p + ".lo", p + ".step"], "lo_steps", {}),
                     ("Neg", [p + ".lo_steps"], "zp0", {}), ("Round", [p + ".zp0"], "zp", {}),
                     ("Cast", [p + ".zp"], "zp8", {"to": TensorProto.UINT8}),
                     ("Reshape", [x, rows], "x2", {}), ("Reshape", [p + ".step", column], "step1", {}),
                     ("Reshape", [p + ".zp8", column], "zp1", {}),
                     ("QuantizeLinear", [p + ".x2", p + ".step1", p + ".zp1"], "u8_2", {"axis": 0}),
                     ("Shape", [x], "shape", {}), ("Reshape", [p + ".u8_2", p + ".shape"], "u8", {}),
                     ("Mul", [p + ".zp", p + ".step"], "zp_step", {})]
            nodes += [helper.make_node(op, ins, [f"{p}.{out}"], name=f"{p}.{out}", **attrs) for op, ins, out, attrs in steps]
            quantized[x] = (p + ".u8", p + ".step", p + ".zp_step")
        u8, step, zp_step = quantized[x]
        scale = np.abs(w).max(axis=0) / 127
        scale = np.where(scale > 0, scale, 1.0).astype(np.float32)
        q = np.clip(np.rint(w / scale), -127, 127)
        wq = const(w_name + ".q8", (q + 128).astype(np.uint8))
        ws = const(w_name + ".q8_scale", scale)
        colsum = const(w_name + ".q8_colsum", (scale * q.sum(axis=0)).astype(np.float32))
        y, o = node.output[0], node.name or node.output[0]
        nodes += [helper.make_node("MatMulIntegerToFloat", [u8, wq, one, ws, "", w_zero], [o + ".q8_acc"],
                                   name=o + ".q8_acc", domain="com.microsoft"),
                  helper.make_node("Mul", [o + ".q8_acc", step], [o + ".q8_scaled"], name=o + ".q8_scaled"),
                  helper.make_node("Mul", [zp_step, colsum], [o + ".q8_zp"], name=o + ".q8_zp"),
                  helper.make_node("Sub", [o + ".q8_scaled", o + ".q8_zp"], [y], name=o + ".q8_out")]
    del g.node[:]
    g.node.extend(nodes)
    used = {i for n in g.node for i in n.input}
    kept = [t for t in g.initializer if t.name in used]
    del g.initializer[:]
    g.initializer.extend(kept)
    if not any(o.domain == "com.microsoft" for o in model.opset_import):
        model.opset_import.append(helper.make_opsetid("com.microsoft", 1))


def _session(path: Path):
    import onnxruntime as ort

    opts = ort.SessionOptions()
    opts.intra_op_num_threads = 1
    return ort.InferenceSession(str(path), opts, providers=["CPUExecutionProvider"])


def check(model: EncoderStudent, fp32: Path, int8: Path, rows: list[list[int]], heads: list[dict],
          tolerance: float, int8_tolerance: float) -> dict[str, float]:
    """Max |ORT fp32 - torch| on logits and max |int8 - fp32| on calibrated probabilities; raises past tolerance."""
    s32, s8 = _session(fp32), _session(int8)
    ids, mask = pad(rows)
    with torch.no_grad():
        ref = model(ids, mask).numpy()
    got = s32.run(["logits"], {"input_ids": ids.numpy(), "attention_mask": mask.numpy()})[0]
    fp32_diff = float(np.abs(got - ref).max())
    worst = 0.0
    for r in rows:  # one unpadded state at a time, as the runtime's batches hold states of one length
        feed = {"input_ids": np.array([r], dtype=np.int64), "attention_mask": np.ones((1, len(r)), dtype=np.int64)}
        a, b = s32.run(["logits"], feed)[0][0], s8.run(["logits"], feed)[0][0]
        for h in heads:  # the probabilities the runtime answers with: float32 logits, the stored T
            sl, t = slice(h["offset"], h["offset"] + h["size"]), h["temperature"]
            worst = max(worst, float(np.abs(softmax(a[sl], t) - softmax(b[sl], t)).max()))
    print(f"export check: max |onnx fp32 - torch| logits = {fp32_diff:.2e} (tolerance {tolerance:.0e}); "
          f"max |int8 - fp32| probability = {worst:.4f} (tolerance {int8_tolerance:g})")
    if not fp32_diff <= tolerance:
        raise ExportCheckError(f"export check failed: ONNX fp32 differs from torch by {fp32_diff:.3e} > export.tolerance {tolerance:.1e}")
    if not worst <= int8_tolerance:
        raise ExportCheckError(f"export check failed: int8 probabilities differ from fp32 by {worst:.4f} > export.int8_tolerance {int8_tolerance:g}")
    return {"fp32_vs_torch_max_abs_logit": fp32_diff, "int8_vs_fp32_max_abs_prob": worst}
