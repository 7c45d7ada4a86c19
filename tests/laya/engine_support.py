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


def bf16_agent(path: str) -> Agent:
    """The packed bf16 engine on any CPU (`laya.load` runs it only where the CPU has bf16 units; elsewhere
    oneDNN emulates bf16, slowly but with the same determinism rules)."""
    from laya.layout import read_parts
    from laya.packed_engine import PackedEngine

    config, encoder_config, tokenizer, weights_path = read_parts(path)
    return Agent(PackedEngine(encoder_config, config, weights_path, Plan("bf16", "bf16", "torch", "cpu", "test")),
                 tokenizer, config, source=path)
