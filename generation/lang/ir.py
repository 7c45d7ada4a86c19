"""The calls a program appends to its state: text, `gen`, `select` and chat-role boundaries.

Each is a small immutable value that records where it was written (`errors.CallSite`); `+` joins them
into a sequence, so `s += "Answer: " + gen("answer") + "\n"` appends three calls in order. Checks that
need no model (a `select` without choices, two constraints at once, an unknown dtype) fail here, at the
program's line, before anything runs.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from generation.lang.choices import ChoiceMethod, token_length_normalized
from generation.lang.errors import CallSite, LangError, call_site

# What `gen(dtype=...)` lets the model write (the variable holds that text, as in SGLang): SGLang's frontend's
# own patterns and stops (sglang.lang.ir, RuntimeEndpoint), so that a program gives the same text on either: a number may be followed by a space or a newline, and that space or
# newline stops it (a model that wants to end a number with "\n" and may not keeps writing digits).
DTYPE_REGEX = {
    "int": r"[-+]?[0-9]+[ \n]*",
    "float": r"[-+]?[0-9]*\.?[0-9]+[ \n]*",
    "bool": r"(True|False)",
    "str": r'"[\w\d\s]*"',
}
DTYPE_STOPS = {"int": [" ", "\n"], "float": [" ", "\n"]}
ROLES = ("system", "user", "assistant")


@dataclass(frozen=True)
class GenParams:
    """A `gen`'s sampling settings; None means "the program's default" (`Program.run(...)`'s arguments)."""

    max_new_tokens: int | None = None
    min_new_tokens: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    frequency_penalty: float | None = None
    presence_penalty: float | None = None
    ignore_eos: bool | None = None
    seed: int | None = None
    return_logprob: bool | None = None
    top_logprobs_num: int | None = None
    regex: str | None = None
    json_schema: str | None = None  # canonical JSON text

    def over(self, defaults: GenParams) -> GenParams:
        """These settings where given, `defaults` elsewhere."""
        given = {f.name: v for f in dataclasses.fields(self) if (v := getattr(self, f.name)) is not None}
        return dataclasses.replace(defaults, **given)

    @property
    def stops(self) -> list[str]:
        return [self.stop] if isinstance(self.stop, str) else list(self.stop or [])

    @property
    def constraint(self) -> dict[str, Any] | None:
        """The constraint spec `generation.constraints` and `/generate` take, if any."""
        if self.regex is not None:
            return {"regex": self.regex}
        if self.json_schema is not None:
            return {"json_schema": self.json_schema}
        return None


SGLANG_DEFAULTS = GenParams(max_new_tokens=128, min_new_tokens=0, stop=[], stop_token_ids=[], temperature=1.0, top_p=1.0, top_k=-1,
                            min_p=0.0, frequency_penalty=0.0, presence_penalty=0.0, ignore_eos=False)


class Expr:
    """Something a program appends to its state. `a + b` is the sequence of both."""

    site: CallSite

    def __add__(self, other: Expr | str) -> Exprs:
        return Exprs([*_items(self), *_items(as_expr(other, self.site))])

    def __radd__(self, other: Expr | str) -> Exprs:
        return Exprs([*_items(as_expr(other, self.site)), *_items(self)])


def _items(expr: Expr) -> list[Expr]:
    return expr.items if isinstance(expr, Exprs) else [expr]


def as_expr(value: Any, site: CallSite) -> Expr:
    if isinstance(value, Expr):
        return value
    if isinstance(value, str):
        return Text(value, site)
    if isinstance(value, list | tuple):
        return Exprs([as_expr(v, site) for v in value])
    what = "None" if value is None else f"a {type(value).__name__}"
    raise LangError(site, f"cannot append {what} to a program's text (append a str, gen, select or role block)")


@dataclass(eq=False)
class Exprs(Expr):
    items: list[Expr]

    @property
    def site(self) -> CallSite:  # type: ignore[override]
        return self.items[0].site if self.items else call_site("+=")


@dataclass(eq=False)
class Text(Expr):
    value: str
    site: CallSite


@dataclass(eq=False)
class Gen(Expr):
    name: str | None
    params: GenParams
    dtype: str | None
    site: CallSite


@dataclass(eq=False)
class Select(Expr):
    name: str | None
    choices: list[str]
    method: ChoiceMethod
    site: CallSite


@dataclass(eq=False)
class RoleBegin(Expr):
    role: str
    site: CallSite


@dataclass(eq=False)
class RoleEnd(Expr):
    role: str
    site: CallSite


def gen(name: str | None = None, max_tokens: int | None = None, *, min_tokens: int | None = None,
        stop: str | list[str] | None = None,
        stop_token_ids: list[int] | None = None, temperature: float | None = None, top_p: float | None = None,
        top_k: int | None = None, min_p: float | None = None, frequency_penalty: float | None = None,
        presence_penalty: float | None = None, ignore_eos: bool | None = None, seed: int | None = None,
        return_logprob: bool | None = None, top_logprobs_num: int | None = None, regex: str | None = None,
        json_schema: str | dict | None = None, dtype: type | str | None = None, choices: list[str] | None = None,
        choices_method: ChoiceMethod | None = None) -> Gen | Select:
    """Let the model continue the text; the result is appended and, with a `name`, kept as `state[name]`.

    Settings left None take the program's defaults (SGLang's: 128 tokens, temperature 1). `min_tokens`: no
    stop (EOS, a stop token or string) before that many tokens. `regex` (whole
    output), `json_schema` (an object or its JSON text) and `dtype` (int, float, str or bool: a literal of
    that type, kept as text) constrain what is written, at most one of them. With `choices`, this is
    `select(name, choices)`."""
    site = call_site(f"gen({name!r})" if name else "gen()")
    if choices is not None:
        if temperature:
            raise LangError(site, "gen(choices=...) picks the most likely choice; temperature must be 0 or unset")
        return _select(site, name, choices, choices_method or token_length_normalized)
    given = [k for k, v in (("regex", regex), ("json_schema", json_schema), ("dtype", dtype)) if v is not None]
    if len(given) > 1:
        raise LangError(site, f"give one of regex, json_schema and dtype, not {' and '.join(given)}")
    dtype_name = None
    if dtype is not None:
        dtype_name = dtype.__name__ if isinstance(dtype, type) else dtype
        if dtype_name not in DTYPE_REGEX:
            raise LangError(site, f"dtype must be one of int, float, str, bool; got {dtype!r}")
        regex = DTYPE_REGEX[dtype_name]
        if dtype_name in DTYPE_STOPS:
            stop = ([stop] if isinstance(stop, str) else list(stop or [])) + DTYPE_STOPS[dtype_name]
    if json_schema is not None and not isinstance(json_schema, str):
        json_schema = json.dumps(json_schema, ensure_ascii=False)
    params = GenParams(max_tokens, min_tokens, stop, stop_token_ids, temperature, top_p, top_k, min_p, frequency_penalty,
                       presence_penalty, ignore_eos, seed, return_logprob, top_logprobs_num, regex, json_schema)
    return Gen(name, params, dtype_name, site)


def gen_int(name: str | None = None, max_tokens: int | None = None, **settings: Any) -> Gen | Select:
    """`gen(..., dtype=int)`, under the name SGLang's frontend exports it by."""
    return gen(name, max_tokens, dtype=int, **settings)


def gen_string(name: str | None = None, max_tokens: int | None = None, **settings: Any) -> Gen | Select:
    """`gen(..., dtype=str)`, under the name SGLang's frontend exports it by."""
    return gen(name, max_tokens, dtype=str, **settings)


def select(name: str | None = None, choices: list[str] | None = None, temperature: float = 0.0,
           choices_method: ChoiceMethod = token_length_normalized) -> Select:
    """Append the choice the model finds most likely after the text so far (see `generation.lang.choices`).

    `temperature` is in SGLang's signature, whose server backend takes only 0 (it scores, it does not sample):
    so here too a choice is picked greedily and any other temperature is refused."""
    site = call_site(f"select({name!r})" if name else "select()")
    if isinstance(temperature, bool) or not isinstance(temperature, int | float) or not 0 <= temperature <= 1e-5:
        raise LangError(site, f"select picks the most likely choice; temperature must be 0, got {temperature!r}")
    return _select(site, name, choices, choices_method)


def _select(site: CallSite, name: str | None, choices: Any, method: Any) -> Select:
    if choices is None or (isinstance(choices, list | tuple) and not choices):
        raise LangError(site, "select needs choices: a non-empty list of strings")
    if not isinstance(choices, list | tuple) or not all(isinstance(c, str) for c in choices):
        raise LangError(site, "choices must be a list of strings")
    if not isinstance(method, ChoiceMethod):
        raise LangError(site, "choices_method must be one of generation.lang's choice methods")
    return Select(name, list(choices), method, site)


def role_block(role: str, expr: Expr | str | None = None, site: CallSite | None = None) -> Exprs:
    """`role`'s chat-template prefix, `expr`, then its suffix."""
    site = site or call_site(f"{role}()")
    inner = [] if expr is None else _items(as_expr(expr, site))
    return Exprs([RoleBegin(role, site), *inner, RoleEnd(role, site)])


def _block(role: str) -> Callable[..., Exprs]:
    def block(expr: Expr | str | None = None) -> Exprs:
        return role_block(role, expr)

    block.__name__ = block.__qualname__ = role
    block.__doc__ = f"A {role} block: the chat template's {role} prefix, `expr`, then its suffix."
    return block


def _boundary(kind: type[RoleBegin] | type[RoleEnd], role: str) -> Callable[[], RoleBegin | RoleEnd]:
    name = f"{role}_{'begin' if kind is RoleBegin else 'end'}"

    def boundary() -> RoleBegin | RoleEnd:
        return kind(role, call_site(f"{name}()"))

    boundary.__name__ = boundary.__qualname__ = name
    return boundary


system, user, assistant = (_block(r) for r in ROLES)
system_begin, user_begin, assistant_begin = (_boundary(RoleBegin, r) for r in ROLES)
system_end, user_end, assistant_end = (_boundary(RoleEnd, r) for r in ROLES)
