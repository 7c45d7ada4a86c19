"""The edge runtime: a distilled student answering its questions with onnxruntime alone.

Imports onnxruntime, tokenizers, numpy and laya's torch-free modules (the answer JSON, the
temperature clamp, question parsing, state-to-text), so a student folder runs on a box with no torch
and no transformers, and answers in exactly the shape a Laya checkpoint does (its
`action.act_probability` is null: a student has no act head). `tests/distill/test_runtime.py`
enforces both.

Determinism: a state's probabilities must not depend on what else shares its batch. Padding changes
the reduction lengths inside attention, so encoder batches only ever hold states of identical token
length. int8 students quantise each token's activations with its own scale (`int8_activations:
per-token` in student.json) and batch the same way; older int8 students used one scale per tensor,
i.e. per batch, and their states run one at a time.
"""

from __future__ import annotations

import os
import warnings
from collections import defaultdict
from pathlib import Path
from typing import Any

import numpy as np
import onnxruntime as ort

from distill.deferral import Deferral, apply_deferral
from distill.inputs import encode, load_tokenizer, normalise_words
from distill.questions import select
from distill.student_folder import read_meta
from laya.answers import answer, check_min_confidence, gate
from laya.calibration import clamp_temperature, softmax
from laya.checks import check_threads
from laya.errors import InputError
from laya.questions import Question, parse_question
from laya.rows import state_text

PER_TOKEN_INT8 = "per-token"   # student.json `int8_activations`: a token's int8 values are its own


class Student:
    """A student folder (`student.json`, `model*.onnx`, `tokenizer.json`) ready to answer.

    `precision` picks `model.int8.onnx` or `model.onnx` (default: the folder's choice); `threads`
    is onnxruntime's intra-op thread count (None: all cores); `max_len` caps state tokens and may
    only lower the budget the student was trained with.
    """

    def __init__(self, path: str | os.PathLike, *, precision: str | None = None, threads: int | None = None,
                 max_len: int | None = None):
        self.path = Path(path)
        meta = read_meta(self.path)
        self.meta = meta
        self.name: str = meta["name"]
        self.kind: str = meta["kind"]
        self.questions: dict[str, dict[str, Any]] = meta["questions"]
        # what the teacher was asked under when it labelled the corpus: a deferred question is asked the same way
        self.teacher_budgets: dict[str, Any] = meta.get("budgets", {}).get("teacher") or {}
        self.parsed: dict[str, Question] = {n: parse_question(n, q) for n, q in self.questions.items()}
        self._heads: dict[str, dict[str, Any]] = {h["name"]: h for h in meta["heads"]}
        self.temperatures = self._temperatures()
        self.precision = precision or meta["default_precision"]
        if self.precision not in meta["models"]:
            raise ValueError("precision: {!r} not in this student (has {})".format(self.precision, sorted(meta["models"])))
        trained_len = int(meta["max_len"])
        if max_len is not None and (isinstance(max_len, bool) or not isinstance(max_len, int)
                                    or not 2 <= max_len <= trained_len):
            raise ValueError(f"max_len: must be an integer between 2 and the trained budget {trained_len}, "
                             f"got {max_len!r}")
        self.max_len = max_len or trained_len
        check_threads(threads, "threads")   # 99999 hung building the session's thread pool
        opts = ort.SessionOptions()
        opts.intra_op_num_threads = threads or 0
        opts.inter_op_num_threads = 1
        opts.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
        self.model_file = self.path / meta["models"][self.precision]
        self._session = ort.InferenceSession(str(self.model_file), opts, providers=["CPUExecutionProvider"])
        self._tokenizer = load_tokenizer(self.path / "tokenizer.json") if self.kind == "encoder" else None
        self._specials = len(self._tokenizer.encode("").ids) if self._tokenizer is not None else 0

    def __repr__(self) -> str:
        return f"Student({str(self.path)!r}, kind={self.kind}, precision={self.precision}, questions={list(self.questions)})"

    def _temperatures(self) -> dict[str, float]:
        """Applied T per question: laya's clamp rule, so a folder written before the clamp cannot sharpen."""
        out = {n: clamp_temperature(h["temperature"]) for n, h in self._heads.items()}
        changed = [f"{n}={h['temperature']!r} -> {out[n]:g}" for n, h in self._heads.items()
                   if out[n] != h["temperature"]]
        if changed:
            warnings.warn(f"{self.path}: student temperatures outside laya's clamp; applying "
                          + ", ".join(changed), RuntimeWarning, stacklevel=3)
        return out

    def select(self, questions: Any = None) -> list[str]:
        """The question names to answer; anything this student was not distilled for is an `InputError`
        naming the question (`distill.questions.select`)."""
        return select(self.questions, questions)

    def predict(self, state: Any, questions: Any = None, *, min_confidence: Any = None,
                defer: Deferral | None = None) -> dict[str, Any]:
        return self.predict_batch([state], questions, min_confidence=min_confidence, defer=defer)[0]

    def predict_batch(self, states: list[Any], questions: Any = None, *, batch_size: int = 32,
                      min_confidence: Any = None, defer: Deferral | None = None) -> list[dict[str, Any]]:
        """Answers as `laya` gives them; `min_confidence` gates on `answer_confidence` as laya does, after `defer`
        (`distill.deferral`) has handed the answers under its thresholds to the teacher."""
        if not isinstance(states, (list, tuple)):
            raise InputError(f"states: expected a list, got {type(states).__name__}", field="states")
        if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
            raise InputError(f"batch_size: must be a positive integer, got {batch_size!r}",
                             field="batch_size")
        names = self.select(questions)
        threshold = check_min_confidence(min_confidence)
        texts = [state_text(s) for s in states]
        if not texts:
            return []
        logits, usage = self._run(texts, batch_size)
        out = []
        for i in range(len(texts)):
            answers = {}
            for n in names:
                z = logits[i, self._heads[n]["offset"]:self._heads[n]["offset"] + self._heads[n]["size"]]
                answers[n] = answer(self.parsed[n], softmax(z, self.temperatures[n]), None)
            u = dict(usage[i])
            u["truncated_questions"] = list(names) if u["truncated"] else []
            out.append({"model": f"student:{self.name}", "answers": answers, "usage": u})
        if defer is not None:
            apply_deferral(defer, list(states), out, self.questions, self.teacher_budgets)
        if threshold is not None:
            for result in out:
                gate(result["answers"], threshold)
        return out

    def logits(self, states: list[Any]) -> np.ndarray:
        """Raw (uncalibrated) logits, all heads concatenated: what reports and calibration read."""
        return self._run([state_text(s) for s in states], 32)[0]

    def _run(self, texts: list[str], batch_size: int) -> tuple[np.ndarray, list[dict]]:
        if self.kind == "encoder":
            return self._run_encoder(texts, batch_size)
        return self._run_linear(texts, batch_size)

    def _run_encoder(self, texts: list[str], batch_size: int) -> tuple[np.ndarray, list[dict]]:
        assert self._tokenizer is not None
        ids, full = encode(self._tokenizer, texts, self.max_len)
        # laya's `state_tokens` counts the state's own tokens; the student's rows add [CLS] and [SEP]
        specials = self._specials
        usage = [{"input_tokens": len(kept), "output_tokens": 0, "state_tokens": n - specials,
                  "state_tokens_dropped": n - len(kept), "truncated": n > len(kept)}
                 for kept, n in zip(ids, full)]
        by_len: dict[int, list[int]] = defaultdict(list)
        for i, row in enumerate(ids):
            by_len[len(row)].append(i)
        per_batch_scale = self.precision == "int8" and self.meta.get("int8_activations") != PER_TOKEN_INT8
        step = 1 if per_batch_scale else batch_size
        out = np.empty((len(texts), self.meta["n_logits"]), dtype=np.float32)
        for rows in by_len.values():
            for start in range(0, len(rows), step):
                chunk = rows[start:start + step]
                input_ids = np.array([ids[i] for i in chunk], dtype=np.int64)
                feed = {"input_ids": input_ids, "attention_mask": np.ones_like(input_ids)}
                out[chunk] = self._session.run(["logits"], feed)[0]
        return out, usage

    def _run_linear(self, texts: list[str], batch_size: int) -> tuple[np.ndarray, list[dict]]:
        out = np.empty((len(texts), self.meta["n_logits"]), dtype=np.float32)
        words = normalise_words(texts)
        for start in range(0, len(texts), batch_size):
            chunk = np.array(words[start:start + batch_size], dtype=object).reshape(-1, 1)
            out[start:start + len(chunk)] = self._session.run(["logits"], {"text": chunk})[0]
        # the words it read (`\w\w+`, lowercased), not the text split on spaces: "a b c d" reads none, and
        # "refund!!!refund" two
        usage = [{"input_tokens": len(w.split()), "output_tokens": 0, "state_tokens": len(w.split()),
                  "state_tokens_dropped": 0, "truncated": False} for w in words]
        return out, usage
