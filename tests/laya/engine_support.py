"""Helpers shared by the engine tests."""

from __future__ import annotations

import laya
from laya.agent import Agent
from laya.precision import Plan


def torch_agent(path: str) -> Agent:
    """The torch engine on CPU, which `laya.load` picks only for GPUs, bf16 and unsupported encoders."""
    from laya.torch_engine import TorchEngine

    base = laya.load(path)
    return Agent(TorchEngine.load(path, Plan("exact", "exact", "torch", "cpu", "test")), base.tokenizer, base.config,
                 source=path)

