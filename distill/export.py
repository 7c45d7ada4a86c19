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


def quantize_int8(src: Path, dst: Path) -> None:
    from onnxruntime.quantization import QuantType, quantize_dynamic

    tmp = dst.with_suffix(".tmp.onnx")
    quantize_dynamic(str(src), str(tmp), weight_type=QuantType.QInt8, per_channel=True,
                     op_types_to_quantize=["MatMul", "Gather"])
    os.replace(tmp, dst)


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
    for r in rows:  # the runtime feeds int8 one unpadded state at a time
        feed = {"input_ids": np.array([r], dtype=np.int64), "attention_mask": np.ones((1, len(r)), dtype=np.int64)}
        a, b = s32.run(["logits"], feed)[0][0], s8.run(["logits"], feed)[0][0]
        for h in heads:  # the probabilities the runtime answers with: float32 logits, the stored T
            sl, t = slice(h["offset"], h["offset"] + h["size"]), h["temperature"]
            worst = max(worst, float(np.abs(softmax(a[sl], t) - softmax(b[sl], t)).max()))
    print(f"export check: max |onnx fp32 - torch| logits = {fp32_diff:.2e} (tolerance {tolerance:.0e}); "
          f"max |int8 - fp32| probability = {worst:.4f} (tolerance {int8_tolerance:.2f})")
    if not fp32_diff <= tolerance:
        raise ExportCheckError(f"export check failed: ONNX fp32 differs from torch by {fp32_diff:.3e} > export.tolerance {tolerance:.1e}")
    if not worst <= int8_tolerance:
        raise ExportCheckError(f"export check failed: int8 probabilities differ from fp32 by {worst:.4f} > export.int8_tolerance {int8_tolerance:.3f}")
    return {"fp32_vs_torch_max_abs_logit": fp32_diff, "int8_vs_fp32_max_abs_prob": worst}
