"""Shared fixtures: tiny random Laya checkpoints in the official layout, built once per session."""

import os
import sys
from pathlib import Path

import pytest

# pytest puts tests/ first on sys.path, where tests/laya (no __init__.py) would shadow the real
# `laya` package as a namespace package; the repository root must come first.
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


@pytest.fixture(scope="session")
def laya_tiny_modernbert(tmp_path_factory) -> str:
    """Path of a tiny ModernBERT-encoder checkpoint (F16 weights, as released)."""
    from laya.testing import build_checkpoint

    return build_checkpoint(tmp_path_factory.mktemp("laya") / "modernbert", arch="modernbert")


@pytest.fixture(scope="session")
def laya_tiny_bert(tmp_path_factory) -> str:
    """Path of a tiny BERT-encoder checkpoint (F32 weights)."""
    from laya.testing import build_checkpoint

    return build_checkpoint(tmp_path_factory.mktemp("laya") / "bert", arch="bert", dtype="f32")
