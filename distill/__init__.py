"""Distillation: Laya's calibrated probabilities into small ONNX students (docs/distill.md).

`distill.runtime` is the edge half (onnxruntime, tokenizers, numpy only); everything else builds
students and imports torch, datasets or scikit-learn inside the functions that need them.
"""
