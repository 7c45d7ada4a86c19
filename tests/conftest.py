"""Shared fixtures: tiny random Laya checkpoints in the official layout, built once per session."""

import json
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
def laya_checkpoint(tmp_path_factory):
    """`laya_checkpoint(**build_checkpoint_args) -> path`, each distinct argument set built once."""
    from laya.testing import build_checkpoint

    built: dict[str, str] = {}

    def build(**kwargs) -> str:
        key = json.dumps(kwargs, sort_keys=True)
        if key not in built:
            built[key] = build_checkpoint(tmp_path_factory.mktemp("laya"), **kwargs)
        return built[key]

    return build


@pytest.fixture(scope="session")
def laya_tiny_modernbert(laya_checkpoint) -> str:
    """Path of a tiny ModernBERT-encoder checkpoint (F16 weights, as released)."""
    return laya_checkpoint(arch="modernbert")


@pytest.fixture(scope="session")
def laya_tiny_bert(laya_checkpoint) -> str:
    """Path of a tiny BERT-encoder checkpoint (F32 weights)."""
    return laya_checkpoint(arch="bert", dtype="f32")
