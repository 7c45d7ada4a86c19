"""`pagoda bench constraints`: grammar engines compared on SmolLM2's vocabulary, and constrained decoding.

Two parts:
  engines  xgrammar, llguidance and outlines-core (whichever are installed) on the embedded SmolLM2
           tokenizer: tokenizer setup, compile time per schema (cold, and again for the same schema),
           time to the first mask, per-token mask time (fill a bitmask for every row, apply it to random
           logits, accept the argmax) at batch 1 and 32, and coverage of the JSON-schema subset the
           issue names plus regex, choices and CFG. Coverage is checked, not assumed: each probe compiles
           a constraint and feeds a valid and an invalid instance, token by token, through the matcher.
  decode   the engine on SmolLM2 itself: per-token time with and without `SamplingParams.constraint`
           at batch 1 and 32 (greedy, EOS ignored so both decode the same tokens; alternating rounds, wall
           and CPU clocks: the best of each, and the median of the rounds' own ratios; the load average
           before and after), the time the grammar processor itself and the engine's whole `sample()`
           take inside each run, compile time of `generation.constraints` cold and cached, and the share
           of outputs that validate on the 20 extraction prompts of `data/extraction_prompts.json`, with
           and without the constraint.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import statistics
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

PROMPTS_FILE = Path(__file__).with_name("data") / "extraction_prompts.json"

# ---- the engine comparison ----------------------------------------------------------------------------

# (name, kind, spec, valid instances, invalid instances). JSON instances are written compactly, the way
# a compact-whitespace grammar must accept them.
PROBES: list[tuple[str, str, Any, list[Any], list[Any]]] = [
    ("types", "json", {"type": "object", "properties": {
        "s": {"type": "string"}, "i": {"type": "integer"}, "n": {"type": "number"}, "b": {"type": "boolean"},
        "z": {"type": "null"}}, "required": ["s", "i", "n", "b", "z"]},
     [{"s": "x", "i": -3, "n": 1.5, "b": True, "z": None}], [{"s": "x", "i": 1.5, "n": 1, "b": True, "z": None}]),
    ("properties+required", "json", {"type": "object", "properties": {"a": {"type": "integer"},
                                                                       "b": {"type": "integer"}}, "required": ["a"]},
     [{"a": 1}, {"a": 1, "b": 2}], [{"b": 1}]),
    ("enum", "json", {"enum": ["red", "green", 3]}, ["green", 3], ["blue"]),
    ("const", "json", {"const": "x"}, ["x"], ["y"]),
    ("items", "json", {"type": "array", "items": {"type": "integer"}}, [[1, 2], []], [[1, "a"]]),
    ("minItems/maxItems", "json", {"type": "array", "items": {"type": "integer"}, "minItems": 2, "maxItems": 3},
     [[1, 2], [1, 2, 3]], [[1], [1, 2, 3, 4]]),
    ("minLength/maxLength", "json", {"type": "string", "minLength": 2, "maxLength": 4}, ["ab", "abcd"], ["a", "abcde"]),
    ("pattern", "json", {"type": "string", "pattern": "^[A-Z]{2}-[0-9]{3}$"}, ["AB-123"], ["ab-123", "AB-12"]),
    ("anyOf", "json", {"anyOf": [{"type": "integer"}, {"type": "object", "properties": {"k": {"type": "string"}},
                                                        "required": ["k"]}]}, [5, {"k": "v"}], ["s", {}]),
    ("nested objects", "json", {"type": "object", "properties": {"a": {"type": "object", "properties": {
        "b": {"type": "object", "properties": {"c": {"type": "integer"}}, "required": ["c"]}}, "required": ["b"]}},
        "required": ["a"]}, [{"a": {"b": {"c": 1}}}], [{"a": {"b": {}}}]),
    ("additionalProperties false", "json", {"type": "object", "properties": {"a": {"type": "integer"}},
                                            "additionalProperties": False}, [{"a": 1}], [{"a": 1, "x": 2}]),
    ("any JSON object", "json", {"type": "object"}, [{"x": [1, {"y": None}]}, {}], [[1], "s"]),
    ("regex", "regex", r"[a-z]+@[a-z]+\.com", ["ab@cd.com"], ["AB@cd.com", "ab@cd"]),
    ("choices", "choices", ["yes", "no", "maybe"], ["maybe", "no"], ["mayb", "yesno"]),
    ("CFG (GBNF)", "grammar", 'root ::= expr\nexpr ::= term ("+" term)*\nterm ::= [0-9]+ | "(" expr ")"',
     ["(1+2)+3", "7"], ["(1+2", "1+"]),
]
# Keywords outside the subset: an engine should either enforce them or refuse the schema, never ignore them.
UNSUPPORTED_PROBES: list[tuple[str, dict[str, Any], Any]] = [
    ("uniqueItems", {"type": "array", "items": {"type": "integer"}, "uniqueItems": True}, [1, 1]),
    ("not", {"not": {"type": "string"}}, "s"),
    ("if/then", {"if": {"type": "integer"}, "then": {"minimum": 5}}, 1),
]
BAD_INPUT = [("invalid regex", "regex", "[a-"), ("invalid pattern", "json", {"type": "string", "pattern": "(a"})]

# Schemas of the timing runs: the three the extraction prompts use most, from small to nested.
TIMING_SCHEMAS: dict[str, dict[str, Any]] = {
    "3 fields": {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"},
                                                  "city": {"type": "string"}},
                 "required": ["name", "age", "city"], "additionalProperties": False},
    "invoice": {"type": "object", "properties": {
        "number": {"type": "string", "pattern": "^INV-[0-9]{4}$"},
        "currency": {"enum": ["EUR", "USD", "GBP"]},
        "lines": {"type": "array", "minItems": 1, "maxItems": 4, "items": {
            "type": "object", "properties": {"item": {"type": "string", "maxLength": 30},
                                             "qty": {"type": "integer"}, "price": {"type": "number"}},
            "required": ["item", "qty", "price"], "additionalProperties": False}},
        "paid": {"type": "boolean"}}, "required": ["number", "currency", "lines", "paid"],
        "additionalProperties": False},
    "event (anyOf)": {"type": "object", "properties": {
        "title": {"type": "string", "minLength": 1, "maxLength": 40},
        "when": {"anyOf": [{"type": "string", "pattern": "^[0-9]{4}-[0-9]{2}-[0-9]{2}$"}, {"type": "null"}]},
        "attendees": {"type": "array", "items": {"type": "object", "properties": {
            "name": {"type": "string"}, "role": {"enum": ["host", "guest"]}}, "required": ["name", "role"],
            "additionalProperties": False}, "maxItems": 5}},
        "required": ["title", "when", "attendees"], "additionalProperties": False},
}


@dataclass
class Vocab:
    """What every candidate is built from: SmolLM2's tokenizer, token strings and stop token."""

    tokenizer: Any  # generation.tokenizer.TextTokenizer
    tokens: list[str]  # byte-level BPE strings ("Ġthe"), "" for control tokens
    token_bytes: list[bytes | None]  # decoded bytes, None for control tokens
    eos: int
    size: int


def model_vocab(model: str | None = None) -> Vocab:
    """The tokenizer alone (the weights are not read), from GGUF metadata or an HF folder's tokenizer.json,
    so the engines part compares on the vocabulary of whatever `--model` names, as the decode part runs it."""
    from generation.tokenizer import TextTokenizer
    from generation.weights import default_model_path

    path = Path(model or default_model_path())
    if path.is_dir():
        tok = TextTokenizer.from_folder(path)
        by_id = {i: s for s, i in tok.tok.get_vocab(with_added_tokens=True).items()}
        config = path / "config.json"
        size = max(json.loads(config.read_text()).get("vocab_size", 0) if config.exists() else 0, max(by_id) + 1)
        special = {i for i, t in tok.tok.get_added_tokens_decoder().items() if t.special}
        raw = [by_id.get(i, "") for i in range(size)]
        control = special | {i for i in range(size) if i not in by_id}
    else:
        from gguf import GGUFReader

        reader = GGUFReader(str(path))
        fields = {k: f.contents() for k, f in reader.fields.items() if k.startswith("tokenizer.")}
        tok = TextTokenizer.from_gguf_fields(fields)
        raw = fields["tokenizer.ggml.tokens"]
        types = fields.get("tokenizer.ggml.token_type") or [1] * len(raw)
        control = {i for i, t in enumerate(types) if t in (3, 4)}
    if tok.eos_token is None or tok.token_id(tok.eos_token) is None:
        raise ValueError(f"--model: {path} names no end-of-sequence token the grammar engines can allow")
    table = _byte_level_table()
    try:
        token_bytes = [None if i in control else bytes(table[c] for c in s) for i, s in enumerate(raw)]
    except KeyError:
        raise ValueError(f"--model: {path}'s tokenizer is not byte-level BPE, which the engines part compares on") \
            from None
    return Vocab(tok, ["" if i in control else s for i, s in enumerate(raw)], token_bytes,
                 tok.token_id(tok.eos_token), len(raw))


def _byte_level_table() -> dict[str, int]:
    """Byte-level BPE's printable stand-in character -> the byte it encodes (outlines-core wants bytes).

    Printable Latin-1 bytes stand for themselves; the other 68 are shifted past 255 in byte order."""
    keep = [*range(0x21, 0x7F), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    shifted = [b for b in range(256) if b not in keep]
    return {chr(b): b for b in keep} | {chr(256 + i): b for i, b in enumerate(shifted)}


def apply_bitmask(logits, bitmask) -> None:
    """The engine's own kernel (`generation.constraints`), so the comparison times what decoding will pay."""
    from generation.constraints import add_bias, bitmask_bias

    add_bias(logits, bitmask_bias(bitmask.numpy()), list(range(logits.shape[0])))


class Candidate:
    """One grammar engine behind the operations the comparison times; `name` is its PyPI name."""

    name = ""

    def __init__(self, vocab: Vocab, threads: int) -> None:
        self.vocab, self.threads = vocab, threads

    def compile(self, kind: str, spec: Any) -> Any:  # raises on a constraint the engine refuses
        raise NotImplementedError

    def matcher(self, compiled: Any) -> Any:
        raise NotImplementedError

    def accept(self, matcher: Any, token: int) -> bool:
        raise NotImplementedError

    def can_end(self, matcher: Any) -> bool:
        raise NotImplementedError

    def fill(self, matchers: list[Any], bitmask) -> None:
        raise NotImplementedError

    @staticmethod
    def version(dist: str) -> str:
        from importlib.metadata import version

        return version(dist)


class XGrammar(Candidate):
    name = "xgrammar"

    def __init__(self, vocab: Vocab, threads: int) -> None:
        super().__init__(vocab, threads)
        import xgrammar as xgr

        self.xgr = xgr
        info = xgr.TokenizerInfo(vocab.tokens, xgr.VocabType.BYTE_LEVEL, vocab_size=vocab.size, stop_token_ids=[vocab.eos])
        self.compiler = xgr.GrammarCompiler(info, max_threads=threads, cache_enabled=True)
        self.batch = xgr.BatchGrammarMatcher(max_threads=threads)

    def compile(self, kind: str, spec: Any) -> Any:
        c = self.compiler
        if kind == "json":
            return c.compile_json_schema(json.dumps(spec), any_whitespace=False, separators=(",", ":"))
        if kind == "regex":
            return c.compile_regex(spec)
        if kind == "choices":
            return c.compile_grammar("root ::= " + " | ".join(json.dumps(s) for s in spec))
        return c.compile_grammar(spec)

    def matcher(self, compiled: Any) -> Any:
        return self.xgr.GrammarMatcher(compiled)

    def accept(self, matcher: Any, token: int) -> bool:
        return matcher.accept_token(token)

    def can_end(self, matcher: Any) -> bool:
        return matcher.is_completed()

    def fill(self, matchers: list[Any], bitmask) -> None:
        if len(matchers) == 1:
            matchers[0].fill_next_token_bitmask(bitmask)
        else:
            self.batch.batch_fill_next_token_bitmask(matchers, bitmask)


class LLGuidance(Candidate):
    name = "llguidance"

    def __init__(self, vocab: Vocab, threads: int) -> None:
        super().__init__(vocab, threads)
        import llguidance

        self.llg = llguidance
        self.tokenizer = llguidance.LLTokenizer(vocab.tokenizer.tok.to_str(), n_vocab=vocab.size, eos_token=vocab.eos)
        self.executor = llguidance.LLExecutor(num_threads=threads)

    def compile(self, kind: str, spec: Any) -> Any:
        llg = self.llg
        if kind == "json":
            grammar = llg.LLMatcher.grammar_from_json_schema(spec, defaults={"whitespace_flexible": False})
        elif kind == "regex":
            grammar = llg.LLMatcher.grammar_from_regex(spec)
        elif kind == "choices":
            grammar = llg.grammar_from("choice", json.dumps(spec))
        else:
            grammar = llg.grammar_from("ebnf", spec)
        matcher = llg.LLMatcher(self.tokenizer, grammar, log_level=0)
        if matcher.is_error():
            raise ValueError(matcher.get_error())
        return matcher

    def matcher(self, compiled: Any) -> Any:
        return compiled.deep_copy()

    def accept(self, matcher: Any, token: int) -> bool:
        return matcher.consume_token(token)

    def can_end(self, matcher: Any) -> bool:
        return matcher.is_accepting()

    def fill(self, matchers: list[Any], bitmask) -> None:
        self.executor.unsafe_compute_mask_ptr([(m, i) for i, m in enumerate(matchers)], bitmask.data_ptr(),
                                              bitmask.shape[1] * 4, bitmask.shape[0])


class OutlinesCore(Candidate):
    """outlines-core compiles a regex into a token-level DFA; JSON schemas become a regex first."""

    name = "outlines-core"

    def __init__(self, vocab: Vocab, threads: int) -> None:
        super().__init__(vocab, threads)
        import outlines_core

        self.oc = outlines_core
        table: dict[bytes, list[int]] = {}
        for i, b in enumerate(vocab.token_bytes):
            if b is not None and i != vocab.eos:
                table.setdefault(b, []).append(i)
        self.vocabulary = outlines_core.Vocabulary(vocab.eos, table)

    def compile(self, kind: str, spec: Any) -> Any:
        if kind == "json":
            regex = self.oc.json_schema.build_regex_from_schema(json.dumps(spec), "")
        elif kind == "regex":
            regex = spec
        elif kind == "choices":
            regex = "|".join(re.escape(s) for s in spec)
        else:
            raise ValueError("outlines-core has no context-free grammars (only regular languages)")
        return self.oc.Index(regex, self.vocabulary)

    def matcher(self, compiled: Any) -> Any:
        return self.oc.Guide(compiled)

    def accept(self, matcher: Any, token: int) -> bool:
        if token == self.vocab.eos:  # its Guide allows EOS in a final state but will not advance on it
            return matcher.is_finished()
        try:
            matcher.advance(token, return_tokens=False)
            return True
        except ValueError:
            return False

    def can_end(self, matcher: Any) -> bool:
        return matcher.is_finished()

    def fill(self, matchers: list[Any], bitmask) -> None:
        for i, m in enumerate(matchers):
            row = bitmask[i]
            m.write_mask_into(row.data_ptr(), row.numel(), 4)


CANDIDATES = {c.name: c for c in (XGrammar, LLGuidance, OutlinesCore)}


def _text(kind: str, instance: Any) -> str:
    return json.dumps(instance, separators=(",", ":")) if kind == "json" else instance


def _matches(cand: Candidate, compiled: Any, text: str) -> bool:
    """Feed `text` as the model's tokenizer would encode it; True if every token is accepted and it can end."""
    m = cand.matcher(compiled)
    return all(cand.accept(m, t) for t in cand.vocab.tokenizer.encode(text)) and cand.can_end(m)


def coverage(cand: Candidate) -> dict[str, str]:
    """Per probe: 'yes' (compiles, accepts the valid, rejects the invalid), or what went wrong."""
    out: dict[str, str] = {}
    for name, kind, spec, good, bad in PROBES:
        try:
            compiled = cand.compile(kind, spec)
        except Exception as exc:
            out[name] = f"refused ({type(exc).__name__})"
            continue
        missed = [g for g in good if not _matches(cand, compiled, _text(kind, g))]
        leaked = [b for b in bad if _matches(cand, compiled, _text(kind, b))]
        out[name] = "yes" if not missed and not leaked else (
            f"rejects valid {_text(kind, missed[0])}" if missed else f"accepts invalid {_text(kind, leaked[0])}")
    for name, schema, violating in UNSUPPORTED_PROBES:
        try:
            compiled = cand.compile("json", schema)
        except Exception:
            out[f"reports {name}"] = "yes (refused)"
            continue
        out[f"reports {name}"] = "ignored" if _matches(cand, compiled, _text("json", violating)) else "yes (enforced)"
    for name, kind, spec in BAD_INPUT:
        try:
            cand.compile(kind, spec)
            out[name] = "accepted"
        except Exception:
            out[name] = "yes (error)"
    return out


def mask_timing(cand: Candidate, compiled: Any, batch: int, steps: int, seed: int = 0) -> dict[str, float]:
    """Per step: fill one bitmask for `batch` rows, mask random logits, accept each row's argmax.

    Rows that end (the argmax was EOS) restart from a fresh matcher, so the walk covers whole outputs."""
    import torch

    gen = torch.Generator().manual_seed(seed)
    size = cand.vocab.size
    bitmask = torch.full((batch, (size + 31) // 32), -1, dtype=torch.int32)
    matchers = [cand.matcher(compiled) for _ in range(batch)]
    fill = apply = accept = 0.0
    finished = 0
    for _ in range(steps):
        logits = torch.randn(batch, size, generator=gen)
        t0 = time.perf_counter()
        cand.fill(matchers, bitmask)
        t1 = time.perf_counter()
        apply_bitmask(logits, bitmask)
        tokens = logits.argmax(-1).tolist()
        t2 = time.perf_counter()
        for i, tok in enumerate(tokens):
            if not cand.accept(matchers[i], tok):
                raise RuntimeError(f"{cand.name} rejected token {tok} it had allowed")
        t3 = time.perf_counter()
        for i, tok in enumerate(tokens):
            if tok == cand.vocab.eos:
                matchers[i] = cand.matcher(compiled)
                finished += 1
        fill, apply, accept = fill + t1 - t0, apply + t2 - t1, accept + t3 - t2
    return {"fill_ms": 1e3 * fill / steps, "apply_ms": 1e3 * apply / steps, "accept_ms": 1e3 * accept / steps,
            "step_ms": 1e3 * (fill + apply + accept) / steps, "finished": finished}


def compare_engines(names: list[str], *, steps: int = 200, threads: int = 1, model: str | None = None) -> dict[str, Any]:
    import torch
    from tqdm import tqdm

    torch.set_num_threads(threads)
    vocab = model_vocab(model)
    results: dict[str, Any] = {}
    for name in names:
        try:
            cls = CANDIDATES[name]
            t = time.perf_counter()
            cand = cls(vocab, threads)
            setup = time.perf_counter() - t
        except ImportError as exc:
            print(f"{name}: not installed ({exc}); skipped")
            continue
        r: dict[str, Any] = {"version": cls.version(name), "tokenizer_setup_s": setup, "schemas": {}}
        for label, schema in tqdm(TIMING_SCHEMAS.items(), desc=f"{name} timing", leave=False):
            t = time.perf_counter()
            compiled = cand.compile("json", schema)
            cold = time.perf_counter() - t
            t = time.perf_counter()
            cand.compile("json", schema)  # the engine's own cache, where it has one
            again = time.perf_counter() - t
            m = cand.matcher(compiled)
            bitmask = torch.full((1, (vocab.size + 31) // 32), -1, dtype=torch.int32)
            t = time.perf_counter()
            cand.fill([m], bitmask)
            first = time.perf_counter() - t
            r["schemas"][label] = {"compile_cold_ms": 1e3 * cold, "compile_again_ms": 1e3 * again,
                                   "first_mask_ms": 1e3 * first,
                                   "b1": mask_timing(cand, compiled, 1, steps),
                                   "b32": mask_timing(cand, compiled, 32, max(steps // 4, 20))}
        r["coverage"] = coverage(cand)
        results[name] = r
        _print_engine(name, r)
    _print_coverage(results)
    return results


def _print_engine(name: str, r: dict[str, Any]) -> None:
    print(f"\n{name} {r['version']}: tokenizer setup {r['tokenizer_setup_s']:.2f} s")
    print(f"  {'schema':<16}{'cold ms':>9}{'again ms':>10}{'1st mask':>10}{'b1 ms/tok':>11}{'b32 ms/step':>13}"
          f"{'b32 fill':>10}")
    for label, s in r["schemas"].items():
        print(f"  {label:<16}{s['compile_cold_ms']:>9.2f}{s['compile_again_ms']:>10.3f}{s['first_mask_ms']:>10.2f}"
              f"{s['b1']['step_ms']:>11.3f}{s['b32']['step_ms']:>13.2f}{s['b32']['fill_ms']:>10.2f}")


def _print_coverage(results: dict[str, Any]) -> None:
    if not results:
        return
    names = list(results)
    probes = list(next(iter(results.values()))["coverage"])
    print(f"\n{'coverage':<28}" + "".join(f"{n:<34}" for n in names))
    for p in probes:
        print(f"{p:<28}" + "".join(f"{results[n]['coverage'][p][:33]:<34}" for n in names))


# ---- constrained decoding in the engine -------------------------------------------------------------------


def extraction_prompts() -> list[dict[str, Any]]:
    """The 20 fixed extraction tasks: a passage and the schema its answer must follow."""
    return json.loads(PROMPTS_FILE.read_text())


def extraction_message(task: dict[str, Any]) -> str:
    return (f"Extract the information from the text below as a JSON object that follows this JSON schema:\n"
            f"{json.dumps(task['schema'])}\n\nText: {task['text']}\n\nAnswer with the JSON object only.")


def unconstrained_json(text: str) -> Any:
    """The JSON object an unconstrained answer holds, read generously: code fences and prose around the
    outermost braces are dropped. Raises ValueError when there is none."""
    start, end = text.find("{"), text.rfind("}")
    if start < 0 or end < start:
        raise ValueError("no JSON object in the answer")
    return json.loads(text[start: end + 1])


def _timed_generate(engine, prompts, params) -> tuple[float, float, int]:
    """Wall seconds, this process's CPU seconds (less swayed by other jobs on a shared machine), tokens."""
    wall, cpu = time.perf_counter(), time.process_time()
    outs = engine.generate(prompts, params)
    return time.perf_counter() - wall, time.process_time() - cpu, sum(len(o.token_ids) for o in outs)


@contextlib.contextmanager
def _grammar_time():
    """Adds the time `GrammarProcessor` spends (masks and accepts) to the yielded dict's `seconds`: the
    overhead measured inside the run itself, which other jobs on a shared machine sway far less than two
    runs' difference. It wraps the class the engine builds for `SamplingParams.constraint`."""
    from generation.constraints import GrammarProcessor

    spent = {"seconds": 0.0}
    apply_batch, accept = GrammarProcessor.__dict__["apply_batch"], GrammarProcessor.accept

    def timed_accept(self, token_id: int) -> None:
        t = time.perf_counter()
        accept(self, token_id)
        spent["seconds"] += time.perf_counter() - t

    def timed_apply(cls, *args) -> None:
        t = time.perf_counter()
        apply_batch.__func__(cls, *args)
        spent["seconds"] += time.perf_counter() - t

    GrammarProcessor.accept, GrammarProcessor.apply_batch = timed_accept, classmethod(timed_apply)
    try:
        yield spent
    finally:
        GrammarProcessor.accept, GrammarProcessor.apply_batch = accept, apply_batch


@contextlib.contextmanager
def _sampler_time():
    """Adds the time the engine's `sample()` takes (processors, the batch argmax, sampling) to the yielded
    dict's `seconds`: with the grammar's own time, what a constrained step adds outside the model's forward,
    measured inside each run like `_grammar_time`."""
    import generation.engine as engine_module

    spent = {"seconds": 0.0}
    sample = engine_module.sample

    def timed(*args):
        t = time.perf_counter()
        try:
            return sample(*args)
        finally:
            spent["seconds"] += time.perf_counter() - t

    engine_module.sample = timed
    try:
        yield spent
    finally:
        engine_module.sample = sample


def _load() -> str:
    return "/".join(f"{x:.1f}" for x in os.getloadavg())


def run_decode(model: str | None = None, *, batches: tuple[int, ...] = (1, 32), new_tokens: int = 32,
               rounds: int = 3, threads: int = 1, validity_tokens: int = 256, validity: bool = True) -> dict[str, Any]:
    """Constrained vs unconstrained decoding on one engine, each ratio from runs in this same process."""
    import jsonschema
    import torch
    from tqdm import tqdm

    from generation import Engine, EngineConfig, SamplingParams
    from generation.constraints import CACHE, processor_from_request

    torch.set_num_threads(threads)
    engine = Engine(EngineConfig(model=model, num_threads=threads))
    tasks = extraction_prompts()
    prompts = [engine.apply_chat_template([{"role": "user", "content": extraction_message(t)}]) for t in tasks]
    results: dict[str, Any] = {"compile": {}, "overhead": {}, "validity": {}}

    # compile: the first call also builds the tokenizer's token trie (once per engine vocabulary)
    CACHE.clear()
    t = time.perf_counter()
    processor_from_request({"regex": "a"}, engine)
    results["tokenizer_setup_s"] = time.perf_counter() - t
    for label, schema in TIMING_SCHEMAS.items():
        t = time.perf_counter()
        processor_from_request({"json_schema": schema}, engine)
        cold = time.perf_counter() - t
        t = time.perf_counter()
        processor_from_request({"json_schema": schema}, engine)
        results["compile"][label] = {"cold_ms": 1e3 * cold, "cached_ms": 1e3 * (time.perf_counter() - t)}
    print(f"tokenizer setup (once per vocabulary) {results['tokenizer_setup_s']:.2f} s")
    for label, c in results["compile"].items():
        print(f"compile {label:<16} cold {c['cold_ms']:7.2f} ms   cached {c['cached_ms']:.3f} ms")

    # per-token time: the same prompts (prefix-cached by a warm-up run), greedy, ignore_eos so both runs
    # decode exactly `new_tokens` per row; a constrained row whose JSON is complete keeps being masked
    for batch in batches:
        chosen = [prompts[i % len(prompts)] + " " * (i // len(prompts)) for i in range(batch)]
        plain = SamplingParams(max_new_tokens=new_tokens, ignore_eos=True)
        constrained = [SamplingParams(max_new_tokens=new_tokens, ignore_eos=True,
                                      constraint={"json_schema": tasks[i % len(tasks)]["schema"]})
                       for i in range(batch)]
        engine.generate(chosen, plain)
        engine.generate(chosen, constrained)
        load_before = _load()
        best = {(name, clock): float("inf") for name in ("unconstrained", "constrained") for clock in ("wall", "cpu")}
        per_round: dict[str, list[float]] = {"wall": [], "cpu": []}
        inside = float("inf")
        sampler = {"unconstrained": float("inf"), "constrained": float("inf")}
        with _grammar_time() as spent, _sampler_time() as sampling:
            for r in tqdm(range(rounds), desc=f"batch {batch}", leave=False):
                order = (("unconstrained", plain), ("constrained", constrained))
                this: dict[tuple[str, str], float] = {}
                for name, params in order if r % 2 == 0 else order[::-1]:
                    spent["seconds"] = sampling["seconds"] = 0.0
                    wall, cpu, tokens = _timed_generate(engine, chosen, params)
                    steps = tokens / batch
                    this[name, "wall"], this[name, "cpu"] = 1e3 * wall / steps, 1e3 * cpu / steps
                    sampler[name] = min(sampler[name], 1e3 * sampling["seconds"] / steps)
                    if name == "constrained":
                        inside = min(inside, 1e3 * spent["seconds"] / steps)
                for key, v in this.items():
                    best[key] = min(best[key], v)
                for clock in ("wall", "cpu"):
                    per_round[clock].append(this["constrained", clock] / this["unconstrained", clock])
        row: dict[str, Any] = {f"{name}_{clock}_ms_per_step": v for (name, clock), v in best.items()}
        row["load_average"] = f"{load_before} -> {_load()}"
        row["processor_ms_per_step"] = inside
        row["processor_share"] = share = inside / best["unconstrained", "wall"]
        print(f"batch {batch:>2}: load average (1/5/15 min) {row['load_average']}")
        print(f"batch {batch:>2}: grammar processor {inside:.2f} ms/step = {100 * share:.2f}% of an unconstrained step")
        row["sampler_ms_per_step"] = sampler
        added = sampler["constrained"] - sampler["unconstrained"]
        print(f"batch {batch:>2}: sample() unconstrained {sampler['unconstrained']:.2f} ms/step, constrained "
              f"{sampler['constrained']:.2f} ms/step (grammar included): +{added:.2f} ms = "
              f"{100 * added / best['unconstrained', 'wall']:.2f}% of an unconstrained step")
        for clock in ("wall", "cpu"):
            row[f"{clock}_ratio"] = ratio = best["constrained", clock] / best["unconstrained", clock]
            row[f"{clock}_round_ratios"] = ratios = per_round[clock]
            row[f"{clock}_median_ratio"] = median = statistics.median(ratios)
            print(f"batch {batch:>2} ({clock}): unconstrained {best['unconstrained', clock]:7.1f} ms/step, "
                  f"constrained {best['constrained', clock]:7.1f} ms/step -> best-of {ratio:.3f}x "
                  f"({100 * (ratio - 1):+.1f}%), median of rounds {median:.3f}x "
                  f"[{', '.join(f'{x:.3f}' for x in ratios)}]")
        results["overhead"][batch] = row

    # validity on the 20 extraction prompts, greedy
    for name in ("unconstrained", "constrained") if validity else ():
        params = [SamplingParams(max_new_tokens=validity_tokens,
                                 constraint={"json_schema": t["schema"]} if name == "constrained" else None)
                  for t in tasks]
        outs = engine.generate(prompts, params)
        valid, rows = 0, []
        for task, out in zip(tasks, outs):
            try:
                value = json.loads(out.text) if name == "constrained" else unconstrained_json(out.text)
                jsonschema.validate(value, task["schema"])
                ok, why = True, ""
            except (ValueError, jsonschema.ValidationError) as exc:
                ok, why = False, str(exc).splitlines()[0][:80]
            valid += ok
            rows.append({"id": task["id"], "valid": ok, "finish_reason": out.finish_reason, "why": why,
                         "text": out.text})
        results["validity"][name] = {"valid": valid, "total": len(tasks), "rows": rows}
        print(f"{name:<13}: {valid}/{len(tasks)} outputs validate against their schema")
    return results
