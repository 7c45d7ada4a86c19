"""Distillation: Laya's calibrated probabilities into small ONNX students (docs/distill.md).

`distill.runtime` is the edge half (onnxruntime, tokenizers, numpy and laya's torch-free modules);
everything else builds students and imports torch, datasets or scikit-learn where it needs them.
"""
