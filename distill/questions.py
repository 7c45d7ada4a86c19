"""Which of a student's questions a request asks: the one rule, for the runtime and for what a server documents.

A student answers only the questions it was distilled for, as they were defined then: its heads answer the
question they were trained on, whatever text a caller puts under that name. The rule reads student.json's
`questions` alone, so `pagoda serve --student` can describe what it will accept (`/openapi.json`) before the
ONNX model loads, and a refusal names the question at fault (`questions.<name>`) as laya's do.
"""

from __future__ import annotations

from typing import Any

from laya.errors import InputError


def select(own: dict[str, Any], questions: Any = None) -> list[str]:
    """The names to answer of `own` (the student's definitions); `questions` is None (all of them), a dict of
    name -> definition, or a list of names. Anything else is an `InputError`."""
    if questions is None:
        return list(own)
    if not isinstance(questions, dict | list | tuple) or not all(isinstance(n, str) for n in questions):
        raise InputError("questions: expected a dict of name -> definition or a list of names, got "
                         f"{type(questions).__name__}" + ("" if not isinstance(questions, list | tuple) else
                                                          " holding a name that is not a string"),
                         field="questions")
    names = list(questions)
    unknown = [n for n in names if n not in own]
    if unknown:
        raise InputError(f"questions {unknown}: this student answers only {sorted(own)}", question=unknown[0])
    if isinstance(questions, dict):
        changed = [n for n in names if questions[n] != own[n]]
        if changed:
            raise InputError(f"questions {changed}: definition differs from the one this student was distilled "
                             "for", question=changed[0])
    if not names:
        raise InputError(f"questions: empty; ask at least one of {sorted(own)}", field="questions")
    return names
