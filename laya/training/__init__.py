"""Making Laya checkpoints: examples, losses, the trainer, temperature calibration, the laya-mini build.

Nothing at inference time imports this package; it may import torch and the corpus builders freely.
"""
