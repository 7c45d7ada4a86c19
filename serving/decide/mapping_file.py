"""Operator files (presets, policies): a JSON or YAML mapping of names, read once at startup.

Errors name the file and what it was for, so a bad `--presets` or `--policy` stops the deploy with a line
an operator can act on; they are `ValueError`s, which `pagoda serve` reports before gunicorn forks.
"""

from __future__ import annotations

import json
from pathlib import Path

import yaml


class _UniqueKeyLoader(yaml.SafeLoader):
    """PyYAML keeps the last of two equal keys; for a file of names that silently drops a preset or a rule."""

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict:
        seen = set()
        for key_node, _ in node.value:
            key = self.construct_object(key_node, deep=deep)
            if key in seen:
                raise yaml.constructor.ConstructorError(None, None, f"{key!r} is given twice", key_node.start_mark)
            seen.add(key)
        return super().construct_mapping(node, deep=deep)


def _unique_pairs(pairs: list[tuple[str, object]]) -> dict:
    keys = [k for k, _ in pairs]
    twice = sorted({k for k in keys if keys.count(k) > 1})
    if twice:
        raise ValueError(f"{twice[0]!r} is given twice")
    return dict(pairs)


def _one_line(exc: Exception) -> str:
    """PyYAML's message spans lines (the context, a caret drawing); a deploy log wants one."""
    if isinstance(exc, yaml.MarkedYAMLError) and exc.problem_mark is not None:
        mark = exc.problem_mark
        return f"{exc.problem} (line {mark.line + 1}, column {mark.column + 1})"
    return " ".join(str(exc).split())


def read_mapping(path: str | Path, what: str) -> dict:
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as exc:
        raise ValueError(f"cannot read {what} file {path}: {exc.strerror}") from None
    except UnicodeDecodeError as exc:
        raise ValueError(f"{what} file {path} is not UTF-8 text: {exc}") from None
    try:
        data = (json.loads(text, object_pairs_hook=_unique_pairs) if path.suffix == ".json"
                else yaml.load(text, Loader=_UniqueKeyLoader))  # a SafeLoader subclass
    except (ValueError, yaml.YAMLError) as exc:  # json.JSONDecodeError is a ValueError
        raise ValueError(f"{what} file {path} is not valid {path.suffix.lstrip('.') or 'YAML'}: "
                         f"{_one_line(exc)}") from None
    if not isinstance(data, dict):
        raise ValueError(f"{what} file {path} must hold a mapping of names, got {type(data).__name__}")
    odd = [k for k in data if not isinstance(k, str)]
    if odd:
        raise ValueError(f"{what} file {path}: name {odd[0]!r} must be a string (quote it)")
    return data
