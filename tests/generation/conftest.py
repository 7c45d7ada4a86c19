"""Fixtures of the engine tests: a tiny random Llama HF folder, built once per session."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from tests.generation.llama_builders import build_tiny_llama

os.environ.setdefault("HF_HUB_OFFLINE", "1")


@pytest.fixture(scope="session")
def tiny_llama(tmp_path_factory) -> Path:
    return build_tiny_llama(tmp_path_factory.mktemp("tiny-llama"))
