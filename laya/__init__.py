"""Laya decisions: `laya.load(path).predict(state, questions)`.

Imports are lazy so `import laya` (and `pagoda --help`) never pulls in torch.
"""

from __future__ import annotations

from typing import Any

__all__ = ["Agent", "load"]


def __getattr__(name: str) -> Any:
    if name in __all__:
        from laya import agent

        return getattr(agent, name)
    raise AttributeError(f"module 'laya' has no attribute {name!r}")
