"""Constrained decoding: a JSON schema, any JSON object, a regex, a list of choices or a grammar -> a logits processor.

Built on llguidance (the comparison with xgrammar and outlines-core, and why, is in docs/generation.md,
"Constrained decoding"). llguidance works on bytes with a token trie, so it masks SmolLM2's byte-level BPE
vocabulary exactly: any tokenization of an allowed text is allowed, and control tokens never are, except the
stop tokens once the grammar can end.

A request asks for a constraint with `SamplingParams(constraint=spec)`. `Constraint.from_spec` checks the
spec when the params are built, without a tokenizer (a bad schema is a `ConstraintError` naming its path,
e.g. `json_schema.properties.tags: unsupported keyword 'uniqueItems'`); the engine then calls
`processor_from_request(constraint, engine)`, which compiles it for the engine's vocabulary (cached) and
returns the prototype processor that each sequence `fork()`s: one llguidance matcher per sequence. All
constrained rows of a step get their masks from one parallel call into one bitmask, applied at once.

What a constraint cannot promise: a request cut short by `max_new_tokens` (finish reason `length`), by a stop
string or by an abort ends with a prefix of a valid output, not a valid output.
"""

from __future__ import annotations

import functools
import json
import threading
import weakref
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from generation.logits_processor import LogitsProcessor

if TYPE_CHECKING:  # no generation module here: config imports this one, and engine and tokenizer import config
    import torch

KINDS = ("json_schema", "json_object", "regex", "choices", "grammar")
WHITESPACE = ("compact", "flexible")

# What llguidance enforces; a schema using any other keyword is refused (with its path) rather than half
# obeyed. `uniqueItems`, `not`, `if`/`then`/`else`, `contains`, `propertyNames`, `dependentRequired`,
# `unevaluated*` and OpenAPI's `nullable` are the ones clients send most that fall outside.
SCHEMA_KEYWORDS = frozenset({
    "type", "properties", "required", "additionalProperties", "patternProperties", "minProperties",
    "maxProperties", "enum", "const", "items", "prefixItems", "minItems", "maxItems", "minLength", "maxLength",
    "pattern", "format", "anyOf", "oneOf", "allOf", "$ref", "$defs", "definitions", "minimum", "maximum",
    "exclusiveMinimum", "exclusiveMaximum", "multipleOf",
})
# Annotations: they describe, they do not constrain, so ignoring them is obeying them.
SCHEMA_ANNOTATIONS = frozenset({
    "title", "description", "default", "examples", "$schema", "$id", "$comment", "deprecated", "readOnly",
    "writeOnly",
})
SCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions")  # name -> subschema
SCHEMA_LISTS = ("anyOf", "oneOf", "allOf", "prefixItems")  # [subschema, ...]
SCHEMA_ONE = ("items", "additionalProperties")  # a subschema (or a boolean)


class ConstraintError(ValueError):
    """A constraint refused: `where` is its place in the spec (`json_schema.properties.tags`, `regex`; empty
    for the spec as a whole), `detail` what is wrong, `field` the `SamplingParams` field it belongs to
    (`constraint.json_schema.properties.tags`), so a server can name its own body field for it."""

    def __init__(self, where: str, detail: str, *, field: str | None = None) -> None:
        super().__init__(f"{where or 'constraint'}: {detail}")
        self.where, self.detail = where, detail
        self.field = field or ("constraint." + where if where else "constraint")


@dataclass(frozen=True)
class Constraint:
    """A validated, tokenizer-free constraint; `text` is canonical (JSON for schemas and choices), so equal
    constraints are equal keys of the compiled-grammar cache."""

    kind: str
    text: str
    whitespace: str = "compact"

    @classmethod
    def from_spec(cls, spec: dict[str, Any]) -> Constraint:
        if not isinstance(spec, dict):
            raise ConstraintError("", "must be an object with one of " + ", ".join(KINDS))
        unknown = sorted(set(spec) - set(KINDS) - {"whitespace"})
        if unknown:
            raise ConstraintError(unknown[0], f"not a constraint field (give one of {', '.join(KINDS)}, "
                                  "optionally with whitespace)")
        given = [k for k in KINDS if k in spec]
        if len(given) != 1:
            raise ConstraintError(given[1] if given else "", f"give exactly one of {', '.join(KINDS)}")
        kind, value = given[0], spec[given[0]]
        whitespace = spec.get("whitespace", "compact")
        if whitespace not in WHITESPACE:
            raise ConstraintError("whitespace", f"must be one of {WHITESPACE}, got {whitespace!r}")
        if whitespace != "compact" and kind not in ("json_schema", "json_object"):
            raise ConstraintError("whitespace", f"applies to json_schema and json_object, not {kind}")
        if kind == "json_schema":
            text = json.dumps(_schema(value), ensure_ascii=False, separators=(",", ":"))
        elif kind == "json_object":
            if value is not True:
                raise ConstraintError("json_object", "must be true (any JSON object)")
            text = '{"type":"object"}'
        elif kind == "choices":
            ok = isinstance(value, list | tuple) and value and all(isinstance(c, str) for c in value)
            if not ok:
                raise ConstraintError("choices", "must be a non-empty list of strings")
            text = json.dumps(list(dict.fromkeys(value)), ensure_ascii=False)
        else:
            if not isinstance(value, str) or not value:
                raise ConstraintError(kind, "must be a non-empty string")
            text = value
        try:  # a lone surrogate ("\ud800", as JSON can spell it) is no text a grammar engine can take
            text.encode("utf-8")
        except UnicodeEncodeError as exc:
            raise ConstraintError(kind, f"not valid Unicode text (a lone surrogate {text[exc.start]!r})") from None
        return cls(kind, text, whitespace)

    def grammar(self) -> str:
        """The llguidance grammar (tokenizer-free)."""
        import llguidance

        if self.kind in ("json_schema", "json_object"):
            try:
                return llguidance.LLMatcher.grammar_from_json_schema(
                    self.text, defaults={"whitespace_flexible": self.whitespace == "flexible"})
            except ValueError as exc:
                raise ConstraintError(self.kind, str(exc)) from None
        if self.kind == "regex":
            return llguidance.LLMatcher.grammar_from_regex(self.text)
        if self.kind == "choices":
            return llguidance.grammar_from("choice", self.text)
        from llguidance.gbnf_to_lark import is_lark_syntax

        text = self.text if is_lark_syntax(self.text) else _gbnf_unicode_escapes(self.text)
        try:  # Lark, or GBNF (llama.cpp / SGLang `ebnf`), which llguidance translates to Lark
            return llguidance.grammar_from("grammar", text)
        except ValueError as exc:
            raise ConstraintError("grammar", str(exc)) from None


_HEX = frozenset("0123456789abcdefABCDEF")


def _gbnf_unicode_escapes(text: str) -> str:
    """A GBNF grammar with its `\\uXXXX` and `\\UXXXXXXXX` escapes (llama.cpp's) spelled so llguidance's
    translation to Lark keeps them: it drops their leading zeros (`\\U0010FFFF` becomes `\\U10FFFF`), which its
    own regex and string lexers then refuse, so every such escape was a 400 (1.9.1).

    Only inside string literals and character classes, scanned as its translator scans them (an escaped
    backslash, `\\\\U...`, and a `#` comment keep their text). A code point below U+0100 becomes `\\xHH`, which
    the translator passes through as the same character (so `"`, `\\`, `]`, `^`, `-` keep their escaped meaning);
    one above becomes the character itself, which no GBNF or regex syntax gives a meaning. A surrogate or a code
    point past U+10FFFF is no character and is refused naming the escape; a malformed escape is left for the
    translator to refuse."""
    out: list[str] = []
    i, n, inside = 0, len(text), ""  # inside: '"' in a string literal, "]" in a character class
    while i < n:
        c = text[i]
        if not inside:
            if c == "#":
                end = text.find("\n", i)
                end = n if end < 0 else end
                out.append(text[i:end])
                i = end
                continue
            inside = {'"': '"', "[": "]"}.get(c, "")
        elif c == "\\" and i + 1 < n:
            width = {"u": 4, "U": 8}.get(text[i + 1], 0)
            digits = text[i + 2:i + 2 + width]
            if width and len(digits) == width and set(digits) <= _HEX:
                point = int(digits, 16)
                escape = text[i:i + 2 + width]
                if 0xD800 <= point <= 0xDFFF:
                    raise ConstraintError("grammar", f"{escape} is a UTF-16 surrogate, not a character (write the "
                                                     "character's own code point)")
                if point > 0x10FFFF:
                    raise ConstraintError("grammar", f"{escape} is past U+10FFFF, the last Unicode code point")
                out.append(f"\\x{point:02X}" if point < 0x100 else chr(point))
                i += 2 + width
            else:
                out.append(text[i:i + 2])
                i += 2
            continue
        elif c == inside:
            inside = ""
        out.append(c)
        i += 1
    return "".join(out)


def _schema(value: Any) -> dict[str, Any]:
    """Parse and check a JSON schema, naming the path of the first keyword that would not be enforced."""
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError as exc:
            raise ConstraintError("json_schema", f"not valid JSON ({exc})") from None
    if value is True:
        return {}
    if not isinstance(value, dict):
        raise ConstraintError("json_schema", "must be a JSON object (a schema)")
    _check_keywords(value, "json_schema")
    return value


def _check_keywords(schema: Any, path: str) -> None:
    if isinstance(schema, bool):
        return
    if not isinstance(schema, dict):
        raise ConstraintError(path, "a schema must be an object or a boolean")
    for key, sub in schema.items():
        if key.startswith("x-"):
            continue
        if key not in SCHEMA_KEYWORDS and key not in SCHEMA_ANNOTATIONS:
            raise ConstraintError(path, f"unsupported keyword {key!r} (it would not be enforced)")
        if key in SCHEMA_MAPS:
            if not isinstance(sub, dict):
                raise ConstraintError(f"{path}.{key}", "must be an object of schemas")
            for name, child in sub.items():
                _check_keywords(child, f"{path}.{key}.{name}")
        elif key in SCHEMA_LISTS:
            if not isinstance(sub, list):
                raise ConstraintError(f"{path}.{key}", "must be a list of schemas")
            for i, child in enumerate(sub):
                _check_keywords(child, f"{path}.{key}[{i}]")
        elif key in SCHEMA_ONE:
            _check_keywords(sub, f"{path}.{key}")


# ---- compiling, cached per tokenizer ----------------------------------------------------------------------


class _Vocabulary:
    """One engine vocabulary as llguidance sees it: the tokenizer, the logits width and the stop tokens."""

    def __init__(self, tokenizer: Any, size: int, eos_ids: tuple[int, ...]) -> None:
        import llguidance

        self.size = size
        self.words = (size + 31) // 32
        self.eos_ids = eos_ids
        self.tokenizer = llguidance.LLTokenizer(tokenizer.tok.to_str(), n_vocab=size, eos_token=list(eos_ids))


@dataclass
class _Compiled:
    """A compiled grammar: a matcher in its start state that is only ever copied, never advanced."""

    constraint: Constraint
    vocabulary: _Vocabulary
    matcher: Any  # llguidance.LLMatcher
    nbytes: int


class GrammarCache:
    """Compiled grammars keyed by (constraint, vocabulary), least recently used evicted first.

    Bounded by entries and by bytes. llguidance does not report a matcher's memory, so the byte count is
    that of the compiled grammar text (the lexer states it builds while masking grow with it); a schema
    seen again skips compilation and reuses the lexer states its earlier requests built."""

    def __init__(self, max_entries: int = 256, max_bytes: int = 64 << 20) -> None:
        self.max_entries, self.max_bytes = max_entries, max_bytes
        self._entries: OrderedDict[tuple[Constraint, _Vocabulary], _Compiled] = OrderedDict()
        self._vocabularies: weakref.WeakKeyDictionary[Any, dict[tuple[int, tuple[int, ...]], _Vocabulary]] = (
            weakref.WeakKeyDictionary())
        self._lock = threading.Lock()  # HTTP threads compile while the engine thread forks
        self.nbytes = 0
        self.hits = self.misses = 0

    def vocabulary(self, tokenizer: Any, size: int, eos_ids: tuple[int, ...]) -> _Vocabulary:
        with self._lock:
            per = self._vocabularies.setdefault(tokenizer, {})
            if (size, eos_ids) not in per:
                per[(size, eos_ids)] = _Vocabulary(tokenizer, size, eos_ids)
            return per[(size, eos_ids)]

    def compile(self, constraint: Constraint, vocabulary: _Vocabulary) -> _Compiled:
        import llguidance

        key = (constraint, vocabulary)
        with self._lock:
            if key in self._entries:
                self._entries.move_to_end(key)
                self.hits += 1
                return self._entries[key]
        grammar = constraint.grammar()
        matcher = llguidance.LLMatcher(vocabulary.tokenizer, grammar, log_level=0)
        if matcher.is_error():
            raise ConstraintError(constraint.kind, matcher.get_error().strip())
        probe = matcher.deep_copy()  # a grammar no text matches compiles; its first mask is where it fails
        probe.compute_bitmask()
        if probe.is_error():  # it would answer 200 with an empty text that it does not match
            raise ConstraintError(constraint.kind, "matches no text: nothing can be generated under it")
        compiled = _Compiled(constraint, vocabulary, matcher, len(grammar))
        with self._lock:
            self.misses += 1
            if key not in self._entries:
                self._entries[key] = compiled
                self.nbytes += compiled.nbytes
            while len(self._entries) > self.max_entries or (self.nbytes > self.max_bytes and len(self._entries) > 1):
                _, old = self._entries.popitem(last=False)
                self.nbytes -= old.nbytes
            return self._entries.get(key, compiled)

    def clear(self) -> None:
        with self._lock:
            self._entries.clear()
            self.nbytes = 0

    def __len__(self) -> int:
        return len(self._entries)


CACHE = GrammarCache()


def processor_from_request(spec: dict[str, Any] | Constraint, engine: Any, *,
                           stop_token_ids: Sequence[int] = ()) -> GrammarProcessor:
    """The prototype processor of one constraint on `engine`'s vocabulary (its tokenizer, logits width and
    EOS ids); the engine calls this for `SamplingParams.constraint`, in the thread that checks the request.

    `spec` has exactly one of `json_schema` (a schema, as an object or a JSON string), `json_object: true`
    (any JSON object), `regex` (Rust regex syntax, matched against the whole output), `choices` (a list of
    strings) or `grammar` (Lark or GBNF), and optionally `whitespace`: `compact` (default: no whitespace
    between JSON tokens, so a weak model cannot wander) or `flexible`. `stop_token_ids` are the request's
    own (`SamplingParams.stop_token_ids`): like EOS, they are allowed exactly when the grammar can end.
    Raises `ConstraintError` (a `ValueError` whose message starts with the field at fault)."""
    constraint = spec if isinstance(spec, Constraint) else Constraint.from_spec(spec)
    vocabulary = CACHE.vocabulary(engine.tokenizer, engine.model_config.vocab_size, tuple(sorted(engine.eos_ids)))
    extra_stops = tuple(sorted(set(stop_token_ids) - set(vocabulary.eos_ids)))
    if any(not 0 <= t < vocabulary.size for t in extra_stops):
        raise ConstraintError("stop_token_ids", "outside the vocabulary", field="stop_token_ids")
    return GrammarProcessor(CACHE.compile(constraint, vocabulary), extra_stops)


# ---- the processor ----------------------------------------------------------------------------------------

_EXECUTOR: Any = None


def _executor():
    """llguidance's thread pool, which computes the masks of all rows of a step in parallel."""
    global _EXECUTOR
    if _EXECUTOR is None:
        import llguidance
        import torch

        _EXECUTOR = llguidance.LLExecutor(num_threads=max(1, torch.get_num_threads()))
    return _EXECUTOR


class GrammarProcessor(LogitsProcessor):
    """Masks a sequence's logits to the tokens its grammar allows next.

    The object `processor_from_request` returns is a prototype; `fork()` gives each sequence its own
    llguidance matcher. The matcher advances in `accept`; since the engine never takes a sampled token
    back (preemption recomputes KV, it does not resample), its state stays valid across preemption. It
    still checks, every step, that it has consumed exactly the sequence's output so far, and replays the
    output into a fresh matcher if not."""

    def __init__(self, compiled: _Compiled, extra_stops: tuple[int, ...] = (), matcher: Any = None) -> None:
        self.compiled = compiled
        self.extra_stops = extra_stops
        self.matcher = matcher
        self.consumed = 0
        self.stopped = False  # one of `extra_stops` was sampled: the engine ends the request

    @property
    def constraint(self) -> Constraint:
        return self.compiled.constraint

    def fork(self) -> GrammarProcessor:
        return GrammarProcessor(self.compiled, self.extra_stops, self.compiled.matcher.deep_copy())

    def __call__(self, prompt_ids: Sequence[int], output_ids: Sequence[int], logits: torch.Tensor) -> None:
        type(self).apply_batch([self], [prompt_ids], [output_ids], logits.unsqueeze(0), [0])

    def accept(self, token_id: int) -> None:
        if self.matcher is None:
            raise RuntimeError("GrammarProcessor: accept on the prototype; the engine uses fork()")
        self.consumed += 1
        if token_id in self.extra_stops:
            self.stopped = True
        elif not self.matcher.consume_token(token_id):
            raise ValueError(f"{self.constraint.kind}: token {token_id} rejected: {self.matcher.get_error()[:300]}")

    def _sync(self, output_ids: Sequence[int]) -> None:
        if self.matcher is None:
            raise RuntimeError("GrammarProcessor: called on the prototype; the engine uses fork()")
        if self.consumed == len(output_ids):
            return
        self.matcher = self.compiled.matcher.deep_copy()
        tokens = [t for t in output_ids if t not in self.extra_stops]
        if not self.matcher.consume_tokens(tokens):
            raise ValueError(f"{self.constraint.kind}: output does not match: {self.matcher.get_error()[:300]}")
        self.consumed = len(output_ids)

    @classmethod
    def apply_batch(cls, processors: list[LogitsProcessor], prompt_ids: list[Sequence[int]],
                    output_ids: list[Sequence[int]], logits: torch.Tensor, rows: list[int]) -> None:
        """One bitmask for all rows, filled by llguidance's pool in one call, added to the logits as 0/-inf."""
        import numpy as np

        procs: list[GrammarProcessor] = processors  # type: ignore[assignment]
        for p, out in zip(procs, output_ids):
            p._sync(out)
        words = max(p.compiled.vocabulary.words for p in procs)
        bitmask = np.zeros((len(procs), words), dtype=np.int32)
        _executor().unsafe_compute_mask_ptr([(p.matcher, i) for i, p in enumerate(procs)], bitmask.ctypes.data,
                                            words * 4, len(procs))
        bias = bitmask_bias(bitmask)
        for i, p in enumerate(procs):
            eos = p.compiled.vocabulary.eos_ids[0]
            if p.stopped:  # ended on one of its own stop tokens: nothing follows but the end
                bias[i] = -np.inf
                bias[i, eos] = 0.0
            elif p.extra_stops:  # the request's own stop tokens follow EOS: allowed exactly when it is
                bias[i, list(p.extra_stops)] = bias[i, eos]
        add_bias(logits, bias, rows)


@functools.cache
def _byte_bias():
    """[256, 8] float32: for each byte of a bitmask, the bias of its 8 tokens (0 if the bit is set, else -inf)."""
    import numpy as np

    bits = np.unpackbits(np.arange(256, dtype=np.uint8)[:, None], axis=1, bitorder="little")
    return np.where(bits == 1, np.float32(0.0), np.float32(-np.inf)).astype(np.float32)


def bitmask_bias(bitmask):
    """[rows, words] int32 bitmask (bit t of a row: token t allowed) -> [rows, 32 * words] float32 bias, 0 where
    allowed and -inf elsewhere. Adding a bias is branch-free, where a masked fill branches on every token (on
    this CPU 4-5x slower at batch 32); a byte-indexed table builds it in one gather."""
    import numpy as np

    return np.take(_byte_bias(), bitmask.view(np.uint8), axis=0).reshape(bitmask.shape[0], -1)


def add_bias(logits: torch.Tensor, bias, rows: list[int]) -> None:
    """`logits[rows[i]] += bias[i]` in place: one add per run of consecutive rows (one for the whole batch
    when every row is constrained), never a copy of the rows. Adding 0 leaves an allowed logit exact."""
    import torch

    bias = bias[:, : logits.shape[-1]]
    start = 0
    for end in range(1, len(rows) + 1):
        if end == len(rows) or rows[end] != rows[end - 1] + 1:
            logits[rows[start]: rows[end - 1] + 1].add_(torch.from_numpy(bias[start:end]))
            start = end
