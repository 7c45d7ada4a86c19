"""Presets: named question sets loaded from a file, so clients send `{"state": ..., "preset": NAME}`.

Every preset is checked at startup, by laya's own question parser and against the server's limits, so a
broken preset stops the server with an error naming it rather than failing each request that uses it.
"""

from __future__ import annotations

from pathlib import Path

from laya.errors import InputError
from laya.questions import check_answer_keys, parse_questions
from serving.decide.config import DecideConfig
from serving.decide.mapping_file import read_mapping
from serving.decide.schema import check_question_counts


def load_presets(path: str | Path, cfg: DecideConfig) -> dict[str, dict]:
    data = read_mapping(path, "presets")
    for name, questions in data.items():
        try:
            check_question_counts(questions, cfg)
            check_answer_keys(parse_questions(questions))
        except InputError as exc:
            raise ValueError(f"preset {name!r} in {path}: {exc}") from None
        if not questions:
            raise ValueError(f"preset {name!r} in {path}: has no questions")
    return data
