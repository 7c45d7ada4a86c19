"""Fixed decision scenarios shipped with the package: the README's example, the bench's workload and
the probe a laya-mini build records. Package data, so an installed (non-editable) pagoda finds them."""

from __future__ import annotations

import json
from importlib import resources
from typing import Any


def load(name: str = "billing") -> tuple[str, dict[str, Any]]:
    """(state, questions) of a shipped scenario."""
    files = resources.files(__name__)
    state_file, questions_file = files / f"{name}_state.txt", files / f"{name}_questions.json"
    if not state_file.is_file():
        known = sorted(p.name.removesuffix("_state.txt") for p in files.iterdir() if p.name.endswith("_state.txt"))
        raise ValueError(f"scenario: unknown name {name!r}; shipped: {', '.join(known)}")
    state = state_file.read_text(encoding="utf-8").removesuffix("\n")
    return state, json.loads(questions_file.read_text(encoding="utf-8"))

