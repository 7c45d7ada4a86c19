"""The inference runtime: validate + tokenise (`prepare`), one padded forward (`forward`), decode (`finish`).

The split exists for serving's cross-request batcher: rows from many requests share one
`forward`, and each request is finished on its own. `predict` is exactly
`finish(p, forward(p.rows))`.

Determinism: a row's padded length is a function of its own length only (rounded up to
`PAD_MULTIPLE`), and rows are grouped by that length, so what else shares a batch never changes
the shapes a row is computed with. See `forward` for the one bound that remains.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from functools import lru_cache
from typing import Any

import numpy as np
import torch

from laya import answers
from laya.batching import collate
from laya.calibration import Temperatures
from laya.checkpoint import load_checkpoint
from laya.config import LayaConfig
from laya.errors import InputError
from laya.modeling_laya import LayaModel
from laya.paths import DEFAULT_MODEL_ENV, default_model_dir
from laya.questions import Question, parse_questions
from laya.rows import Budgets, Row, build_rows, check_state, encode_head
from laya.tokenizer import LayaTokenizer

PAD_MULTIPLE = 16
MAX_BATCH_TOKENS = 16384


@dataclass
class Prepared:
    """A validated, tokenised request: everything `finish` needs besides the model outputs."""

    questions: list[Question]
    rows: list[Row]
    min_confidence: float | dict[str, float] | None = None


@dataclass
class RowOutput:
    logits: np.ndarray          # float32 [k], slot order, untempered
    act_probabilities: np.ndarray


class Agent:
    def __init__(self, model: LayaModel, tokenizer: LayaTokenizer, config: LayaConfig,
                 device: str = "cpu", source: str | None = None):
        self.device = torch.device(device)
        self.model = model.to(self.device).eval()
        self.tokenizer = tokenizer
        self.config = config
        self.source = source
        self.temperatures = Temperatures.from_config(config.temperature, config.temperature_by_options)
        # Questions repeat across requests far more than states do; their token ids do not depend
        # on the state or the budgets, so they are tokenised once per distinct question.
        self._encode_head = lru_cache(maxsize=4096)(lambda q: encode_head(tokenizer, q))

    def budgets(self, max_len: int | None = None, head_max_len: int | None = None) -> Budgets:
        return Budgets(self.config.max_len if max_len is None else max_len,
                       self.config.head_max_len if head_max_len is None else head_max_len)

    def prepare(self, state: Any, questions: Any, *, max_len: int | None = None, head_max_len: int | None = None,
                min_confidence: Any = None, option_order: dict[str, Any] | None = None) -> Prepared:
        """Validate and tokenise one request; every bad input raises `InputError` here, before any compute."""
        check_state(state)
        parsed = parse_questions(questions, option_order)
        budgets = self.budgets(max_len, head_max_len)
        gate = answers.check_min_confidence(min_confidence)
        if not parsed:
            return Prepared([], [], gate)
        heads = [self._encode_head(q) for q in parsed]
        return Prepared(parsed, build_rows(self.tokenizer, state, parsed, budgets, heads), gate)

    @torch.inference_mode()
    def forward(self, rows: list[Row]) -> list[RowOutput]:
        """One output per row, in order; rows may come from any number of `Prepared`.

        Rows are padded to a multiple of PAD_MULTIPLE of their own length and only rows of equal
        padded length share a tensor, in chunks of at most MAX_BATCH_TOKENS; the small matmuls
        after the last head layer's keys and values run per row (see `LayaModel.infer`). What
        remains is the batch dimension of the large matmuls, whose per-row results do not depend
        on it on CPU; `tests/laya/test_agent.py` checks bit-identity across batch compositions.
        """
        out: list[RowOutput | None] = [None] * len(rows)
        groups: dict[int, list[int]] = {}
        for i, r in enumerate(rows):
            groups.setdefault(-(-r.n_tokens // PAD_MULTIPLE) * PAD_MULTIPLE, []).append(i)
        for length, members in sorted(groups.items()):
            step = max(1, MAX_BATCH_TOKENS // length)
            for start in range(0, len(members), step):
                chunk = members[start:start + step]
                batch = collate([rows[i] for i in chunk], self.tokenizer.pad_token_id, length)
                batch = {k: v.to(self.device) for k, v in batch.items()}
                per_row = self.model.infer(batch["input_ids"], batch["attention_mask"], batch["qtype"],
                                           batch["marker_pos"], [len(rows[i].markers) for i in chunk])
                for i, (logits, act) in zip(chunk, per_row):
                    out[i] = RowOutput(logits.float().cpu().numpy(), torch.softmax(act.float(), -1).cpu().numpy())
        return out  # type: ignore[return-value]

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

    def predict_batch(self, states: list[Any], questions: Any, *, batch_size: int = 32,
                      sort_by_length: bool = True, **kwargs: Any) -> list[dict[str, Any]]:
        """Many states against the same questions; results equal `predict` on each state, bit for bit.

        `batch_size` bounds states per forward; `sort_by_length` groups states of similar length so
        chunks carry less padding (it cannot change results: see `forward`).
        """
        if not isinstance(states, list):
            raise InputError(f"states: expected a list of states, got {type(states).__name__}", field="states")
        if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
            raise InputError(f"batch_size: must be a positive integer, got {batch_size!r}", field="batch_size")
        prepared = [self.prepare(s, questions, **kwargs) for s in states]
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


def load(path: str | os.PathLike | None = None, device: str = "cpu") -> Agent:
    """An `Agent` for an official-layout checkpoint folder; `None` loads the embedded laya-mini."""
    if path is None:
        path = default_model_dir()
        if not (path / "rl_agent_config.json").is_file():
            raise FileNotFoundError(f"the default model is not built at {path} (run `pagoda laya-mini build`, "
                                    f"or set ${DEFAULT_MODEL_ENV} to a built copy)")
    model, tokenizer, config = load_checkpoint(str(path))
    return Agent(model, tokenizer, config, device=device, source=str(path))
