"""The inference runtime: validate + tokenise (`prepare`), one forward over rows (`forward`), decode (`finish`).

The split exists for serving's cross-request batcher: rows from many requests share one
`forward`, and each request is finished on its own. `predict` is exactly
`finish(p, forward(p.rows))`. The forward is an engine's (`laya.engine`): onnxruntime on CPU for
exact and int8, packed bf16 GEMMs on torch for bf16 on CPU, `LayaModel` for GPUs, chosen by
`laya.precision.plan` at load. Whatever the
engine, a row's result is bit-identical on repeat and whatever shares its forward.

This module imports no torch: on the CPU engines a process decides without ever loading it.
"""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass
from functools import cached_property
from typing import Any

from laya import answers
from laya.calibration import Temperatures
from laya.checks import check_threads
from laya.config import LayaConfig
from laya.engine import Engine, RowOutput
from laya.errors import InputError, in_batch
from laya.layout import encoder_positions, read_parts
from laya.lru import ByteLRU
from laya.paths import DEFAULT_MODEL_ENV, default_model_dir
from laya.precision import Plan, check_device, plan
from laya.questions import Question, check_answer_keys, parse_questions
from laya.rows import Budgets, Row, build_rows, check_state, encode_head
from laya.tokenizer import LayaTokenizer

__all__ = ["Agent", "Prepared", "RowOutput", "load"]

# What the question-token cache may hold per process. Questions repeat across requests, but a client can
# send a new 900 KB one each time: bounded by entries, that cache grew ~8 MB per request for 4096 requests.
DEFAULT_QUESTION_CACHE_BYTES = 64 << 20


@dataclass
class Prepared:
    """A validated, tokenised request: everything `finish` needs besides the model outputs."""

    questions: list[Question]
    rows: list[Row]
    min_confidence: float | dict[str, float] | None = None


class Agent:
    """`max_positions`: the encoder's position count (its `max_position_embeddings`); a budget past it is
    refused at `prepare`, since the forward would fail on it (and, in a server, fail the batch it shares).
    `question_cache_bytes`: the bound of the question-token cache (0: no cache)."""

    def __init__(self, engine: Engine, tokenizer: LayaTokenizer, config: LayaConfig, source: str | None = None,
                 max_positions: int | None = None, question_cache_bytes: int = DEFAULT_QUESTION_CACHE_BYTES):
        self.engine = engine
        self.tokenizer = tokenizer
        self.config = config
        self.source = source
        self.max_positions = max_positions
        if max_positions is not None:
            for name in ("max_len", "head_max_len"):
                if getattr(config, name) > max_positions:
                    raise ValueError(f"rl_agent_config.json: {name} {getattr(config, name)} is more than the "
                                     f"encoder's {max_positions} positions (max_position_embeddings)")
        self.temperatures = Temperatures.from_config(config.temperature, config.temperature_by_options)
        # Questions repeat across requests far more than states do; their token ids do not depend
        # on the state or the budgets, so they are tokenised once per distinct question.
        self.question_cache = ByteLRU(question_cache_bytes, _head_bytes)

    @property
    def plan(self) -> Plan:
        return self.engine.plan

    @cached_property
    def model(self):
        """The torch `LayaModel` of this checkpoint (training, evaluation); the torch engine's own, else
        loaded on first use, so the CPU engines never pay for it."""
        own = getattr(self.engine, "model", None)
        if own is not None:
            return own
        from laya.checkpoint import load_checkpoint

        if self.source is None:
            raise ValueError("this agent was built without a checkpoint folder; it has no torch model")
        return load_checkpoint(self.source)[0]

    def budgets(self, max_len: int | None = None, head_max_len: int | None = None) -> Budgets:
        budgets = Budgets(self.config.max_len if max_len is None else max_len,
                          self.config.head_max_len if head_max_len is None else head_max_len)
        if self.max_positions is not None:
            for name in ("max_len", "head_max_len"):
                if getattr(budgets, name) > self.max_positions:
                    raise InputError(f"{name}: {getattr(budgets, name)} is more than this model's "
                                     f"{self.max_positions} positions", field=name)
        return budgets

    def _head(self, q: Question) -> tuple[list[int], list[list[int]]]:
        def compute() -> tuple[list[int], list[list[int]]]:
            ins_ids, opt_ids = encode_head(self.tokenizer, q)
            # A row never holds more instruction tokens than positions (budgets are checked against them),
            # so the cache keeps no more: 900 KB of instructions cost 512 ids, not 200,000.
            return (ins_ids if self.max_positions is None else ins_ids[:self.max_positions]), opt_ids

        return self.question_cache.get(q, compute)

    def prepare(self, state: Any, questions: Any, *, max_len: int | None = None, head_max_len: int | None = None,
                min_confidence: Any = None, option_order: dict[str, Any] | None = None,
                lang: str | None = None) -> Prepared:
        """Validate and tokenise one request; every bad input raises `InputError` here, before any compute.

        `lang` picks per-language temperatures in the official runtime, which only a `lang_temperatures`
        given at load has; no checkpoint carries them and `load` takes none here, so, as there, it changes
        nothing (it is taken so that calls written for that runtime run unchanged)."""
        if lang is not None and not isinstance(lang, str):
            raise InputError(f"lang: must be a language code string, got {type(lang).__name__}", field="lang")
        check_state(state)
        parsed = parse_questions(questions, option_order)
        budgets = self.budgets(max_len, head_max_len)
        gate = answers.check_min_confidence(min_confidence)
        if not parsed:
            return Prepared([], [], gate)
        check_answer_keys(parsed)
        heads = [self._head(q) for q in parsed]
        return Prepared(parsed, build_rows(self.tokenizer, state, parsed, budgets, heads), gate)

    def forward(self, rows: list[Row]) -> list[RowOutput]:
        """One output per row, in order; rows may come from any number of `Prepared`, and a row's
        result never depends on which (`tests/laya/test_agent.py` checks it for every engine)."""
        return self.engine.forward(rows)

    def finish(self, prepared: Prepared, outputs: list[RowOutput]) -> dict[str, Any]:
        result_answers = {}
        for q, row, o in zip(prepared.questions, prepared.rows, outputs):
            t = self.temperatures.lookup(q.qtype, len(row.markers))
            p = answers.probabilities(o.logits, t, q.option_order)
            result_answers[q.name] = answers.answer(q, p, float(o.act_probabilities[0]))
        if prepared.min_confidence is not None:
            answers.gate(result_answers, prepared.min_confidence)
        return {"model": answers.MODEL_NAME, "answers": result_answers, "usage": answers.usage(prepared.rows)}

    def predict(self, state: Any, questions: Any, **kwargs: Any) -> dict[str, Any]:
        prepared = self.prepare(state, questions, **kwargs)
        return self.finish(prepared, self.forward(prepared.rows) if prepared.rows else [])

    def _prepare_nth(self, i: int, state: Any, questions: Any, kwargs: dict[str, Any]) -> Prepared:
        """`prepare`, with a state's own mistake named `states[i]`: in a batch, `state` would not say which."""
        try:
            return self.prepare(state, questions, **kwargs)
        except InputError as exc:
            if exc.path != "state":
                raise
            raise in_batch(exc, i) from None

    def predict_batch(self, states: list[Any], questions: Any, *, batch_size: int | None = 32,
                      sort_by_length: bool = True, **kwargs: Any) -> list[dict[str, Any]]:
        """Many states against the same questions; results equal `predict` on each state, bit for bit.

        `batch_size` bounds states per forward (None, 0 or a negative: all in one, as the official runtime reads
        them); a state's own mistake names it `states[i]`; `sort_by_length` groups states of similar length so
        chunks carry less padding (it cannot change results: see `forward`).
        """
        if not isinstance(states, list | tuple):
            raise InputError(f"states: expected a list of states, got {type(states).__name__}", field="states")
        if batch_size is not None and (isinstance(batch_size, bool) or not isinstance(batch_size, int)):
            raise InputError(f"batch_size: must be an integer (0, a negative or None: all states in one pass), got "
                             f"{batch_size!r}", field="batch_size")
        # None, 0 or a negative: one pass, as the official runtime reads them (None is its default)
        batch_size = batch_size if batch_size is not None and batch_size > 0 else max(len(states), 1)
        prepared = [self._prepare_nth(i, s, questions, kwargs) for i, s in enumerate(states)]
        order = list(range(len(prepared)))
        if sort_by_length:
            order.sort(key=lambda i: max((r.n_tokens for r in prepared[i].rows), default=0))
        results: list[dict[str, Any] | None] = [None] * len(prepared)
        for start in range(0, len(order), batch_size):
            chunk = order[start:start + batch_size]
            rows = [r for i in chunk for r in prepared[i].rows]
            outputs = self.forward(rows) if rows else []
            offset = 0
            for i in chunk:
                n = len(prepared[i].rows)
                results[i] = self.finish(prepared[i], outputs[offset:offset + n])
                offset += n
        return results  # type: ignore[return-value]


def _head_bytes(q: Question, head: tuple[list[int], list[list[int]]]) -> int:
    """What one cached question holds: its texts (the key) and its id lists (a slot and an int object per id;
    ids above 256 are not shared)."""
    ins_ids, opt_ids = head
    texts = sum(sys.getsizeof(t) for t in (q.name, q.instructions, *q.options, *q.legend))
    ids = sum(sys.getsizeof(ids) + 28 * len(ids) for ids in (ins_ids, *opt_ids))
    return texts + ids


def load(path: str | os.PathLike | None = None, device: str = "cpu", precision: str | None = None,
         threads: int | None = None, question_cache_bytes: int = DEFAULT_QUESTION_CACHE_BYTES) -> Agent:
    """An `Agent` for an official-layout checkpoint folder; `None` loads the embedded laya-mini.

    `precision`: exact (default), int8, bf16 or fast (see `laya.precision`); None reads
    `$PAGODA_PRECISION`. `threads`: intra-op threads (default: `$OMP_NUM_THREADS`, else the runtime's).
    `question_cache_bytes`: the bound of the question-token cache.
    """
    check_threads(threads, "threads")  # 1 to MAX_THREADS, as every --threads: torch segfaults or hangs on 99999
    if threads is None:  # the default comes from the environment, and hangs the same way (onnxruntime on 5000)
        given = os.environ.get("OMP_NUM_THREADS", "")
        if given.isdigit() and int(given) > 0:
            check_threads(int(given), "$OMP_NUM_THREADS (the default of threads)")
    if path is None:
        path = default_model_dir()
        if not (path / "rl_agent_config.json").is_file():
            raise FileNotFoundError(f"the default model is not built at {path} (run `pagoda laya-mini build`, "
                                    f"or set ${DEFAULT_MODEL_ENV} to a built copy)")
    path = str(path)
    config, encoder_config, tokenizer, weights_path = read_parts(path)
    chosen = plan(precision, check_device(device, "device"))
    return Agent(_engine(path, config, encoder_config, weights_path, chosen, threads), tokenizer, config, source=path,
                 max_positions=encoder_positions(encoder_config),
                 question_cache_bytes=question_cache_bytes)


def _engine(path: str, config: LayaConfig, encoder_config: dict, weights_path: str, chosen: Plan,
            threads: int | None) -> Engine:
    """The engine for `chosen`. A checkpoint whose encoder the ONNX graph does not build runs exact on torch
    (with a warning saying why); int8 has no such fallback and is refused. bf16 on CPU runs packed
    (`laya.packed_engine`), or for such an encoder `LayaModel` under autocast."""
    if chosen.backend == "onnxruntime":
        from laya.onnx_engine import OnnxEngine
        from laya.onnx_graph import Unsupported

        try:
            return OnnxEngine(encoder_config, config, weights_path, chosen, threads)
        except Unsupported as exc:
            if chosen.precision != "exact":
                raise ValueError(f"precision {chosen.precision!r}: {exc} is not built by the onnxruntime "
                                 "path; use precision 'exact'") from None
            import warnings

            warnings.warn(f"{path}: {exc}; running the torch model instead", RuntimeWarning, stacklevel=3)
            chosen = Plan(chosen.requested, "exact", "torch", chosen.device, f"torch fallback: {exc}")
    if chosen.precision == "bf16" and chosen.device == "cpu":
        from laya.onnx_graph import Unsupported
        from laya.packed_engine import PackedEngine

        try:
            return PackedEngine(encoder_config, config, weights_path, chosen, threads)
        except Unsupported as exc:
            import warnings

            warnings.warn(f"{path}: {exc}; running bf16 on the torch model (autocast, one row per forward)",
                          RuntimeWarning, stacklevel=3)
    from laya.torch_engine import TorchEngine

    return TorchEngine.load(path, chosen, threads)
