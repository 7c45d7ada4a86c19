"""docs/architecture.md's CLI table is where a reader looks for the module behind a command, so it must list
every command each registered module adds, and nothing it does not (it had fallen behind `laya-mini` and
`bench soak`)."""

from __future__ import annotations

import argparse
import importlib
import re
from pathlib import Path

from serving.cli import COMMAND_MODULES

DOC = Path(__file__).resolve().parents[2] / "docs" / "architecture.md"


def _registered(module: str) -> set[str]:
    """The commands `module.register` adds, nested actions (`laya-mini build`) spelled out."""
    commands, bench = argparse.ArgumentParser().add_subparsers(), argparse.ArgumentParser().add_subparsers()
    importlib.import_module(module).register(commands, bench)

    def names(group, prefix: str) -> set[str]:
        out = set()
        for name, sub in group.choices.items():
            nested = [a for a in sub._actions if isinstance(a, argparse._SubParsersAction)]
            out |= names(nested[0], f"{prefix}{name} ") if nested else {prefix + name}
        return out

    return names(commands, "") | names(bench, "bench ")


def _documented() -> dict[str, set[str]]:
    rows = {}
    for line in DOC.read_text().splitlines():
        m = re.fullmatch(r"\| `([\w.]+)` \| (.+) \|", line)
        if m and m.group(1) in COMMAND_MODULES:
            rows[m.group(1)] = set(re.findall(r"`([^`]+)`", m.group(2)))
    return rows


def test_the_architecture_cli_table_lists_what_each_module_registers():
    documented = _documented()
    assert set(documented) == set(COMMAND_MODULES)
    for module in COMMAND_MODULES:
        assert documented[module] == _registered(module), module
