"""Typed input errors: the contract between laya's validation and whoever reports it.

Serving answers a bad request with the JSON path of the offending field; before this type existed it
recovered that path by parsing message text, so rewording a message broke an HTTP API. An
`InputError` carries the question and field as attributes and stays a `ValueError`, so callers that
only catch `ValueError` keep working.
"""

from __future__ import annotations


class InputError(ValueError):
    """A caller's mistake, named: `question` (or None) and `field` (or None), plus a readable message."""

    def __init__(self, message: str, *, field: str | None = None, question: str | None = None,
                 at: str | None = None):
        super().__init__(message)
        self.field = field
        self.question = question
        self._at = at

    @property
    def path(self) -> str:
        """Where the mistake sits in a `predict(state, questions, **budgets)` call, as a dotted path.

        `questions.<name>.<field>` for a question's own field, `<field>` for a request-level one, or what the
        raiser said (`at`): a question's error whose cure is a request argument (its markers do not fit
        `max_len`) points there. Never guessed from the field's name: a question may hold a field called
        `state` or `max_len` (an unknown one), and that is the question's mistake."""
        if self._at is not None:
            return self._at
        if self.question is None:
            return self.field or "questions"
        return f"questions.{self.question}.{self.field}" if self.field else f"questions.{self.question}"


def in_batch(exc: InputError, i: int) -> InputError:
    """A state's own mistake (path `state`) as a batch must say it: `states[i]`, or no one knows which state."""
    message = str(exc)
    return InputError(f"states[{i}]{message.removeprefix('state')}" if message.startswith("state") else
                      f"states[{i}]: {message}", field=f"states[{i}]")


def question_error(name: object, field: str, message: str, at: str | None = None) -> InputError:
    """The one message format for a question's field: `question 'q': field 'f': ...`."""
    return InputError(f"question {name!r}: field {field!r}: {message}", field=field,
                      question=name if isinstance(name, str) else repr(name), at=at)
