"""The edge runtime: a distilled student answering its questions with onnxruntime alone.

Imports only onnxruntime, tokenizers and numpy (and `distill.answers`, which is numpy) so a student
folder runs on a box with no torch and no transformers; `tests/distill/test_runtime.py` enforces it.

Determinism: a state's probabilities must not depend on what else shares its batch. Padding changes
the reduction lengths inside attention, and dynamic int8 quantisation picks one activation scale per
tensor, i.e. per batch. So fp32 encoder batches only ever hold states of identical token length, and
int8 encoder states run one at a time (the int8 model is built for batch-1 edge latency anyway).
"""

from __future__ import annotations

import json
import os
import re
from collections import defaultdict
from pathlib import Path
from typing import Any

import numpy as np
import onnxruntime as ort
from tokenizers import Tokenizer

from distill.answers import answer_from_probs, softmax

FORMAT = "pagoda-student/1"
PRECISIONS = ("int8", "fp32")


WORD = re.compile(r"(?u)\b\w\w+\b")


def prepare_text(texts: list[str]) -> list[str]:
    """The linear student's input normalisation (see `distill.linear`): lowercase words, single spaces."""
    return [" ".join(WORD.findall(t.lower())) for t in texts]


def state_text(state: Any) -> str:
    """States are text; structured states read as JSON, as the teacher was shown them."""
    if isinstance(state, str):
        return state
    if isinstance(state, (dict, list)):
        return json.dumps(state, ensure_ascii=False)
    raise ValueError(f"state: expected a string, dict or list, got {type(state).__name__}")


class Student:
    """A student folder (`student.json`, `model*.onnx`, `tokenizer.json`) ready to answer.

    `precision` picks `model.int8.onnx` or `model.onnx` (default: the folder's choice); `threads`
    is onnxruntime's intra-op thread count (None: all cores); `max_len` caps state tokens and may
    only lower the budget the student was trained with.
    """

    def __init__(self, path: str | os.PathLike, *, precision: str | None = None, threads: int | None = None,
                 max_len: int | None = None):
        self.path = Path(path)
        meta_path = self.path / "student.json"
        if not meta_path.is_file():
            raise FileNotFoundError(f"{self.path}: not a student folder (no student.json)")
        meta = json.loads(meta_path.read_text())
        if meta.get("format") != FORMAT:
            raise ValueError("{}: student.json field 'format' is {!r}, expected {!r}".format(self.path, meta.get("format"), FORMAT))
        self.meta = meta
        self.name: str = meta["name"]
        self.kind: str = meta["kind"]
        self.questions: dict[str, dict[str, Any]] = meta["questions"]
        self._heads: list[dict[str, Any]] = meta["heads"]
        self.precision = precision or meta["default_precision"]
        if self.precision not in meta["models"]:
            raise ValueError("precision: {!r} not in this student (has {})".format(self.precision, sorted(meta["models"])))
        trained_len = int(meta["max_len"])
        if max_len is not None and not 2 <= int(max_len) <= trained_len:
            raise ValueError(f"max_len: must be between 2 and the trained budget {trained_len}, got {max_len!r}")
        self.max_len = int(max_len or trained_len)
        if threads is not None and (isinstance(threads, bool) or not isinstance(threads, int) or threads < 1):
            raise ValueError(f"threads: must be a positive integer or None, got {threads!r}")
        opts = ort.SessionOptions()
        opts.intra_op_num_threads = threads or 0
        opts.inter_op_num_threads = 1
        opts.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
        self.model_file = self.path / meta["models"][self.precision]
        self._session = ort.InferenceSession(str(self.model_file), opts, providers=["CPUExecutionProvider"])
        self._tokenizer: Tokenizer | None = None
        if self.kind == "encoder":
            self._tokenizer = Tokenizer.from_file(str(self.path / "tokenizer.json"))
            self._tokenizer.no_truncation()
            self._tokenizer.no_padding()

    def __repr__(self) -> str:
        return f"Student({str(self.path)!r}, kind={self.kind}, precision={self.precision}, questions={list(self.questions)})"

    def select(self, questions: Any = None) -> list[str]:
        """The question names to answer; anything this student was not distilled for is a ValueError.

        A definition that differs from the distilled one is refused too: the heads answer the
        question they were trained on, whatever text the caller puts under that name.
        """
        if questions is None:
            return list(self.questions)
        names = list(questions)
        unknown = [n for n in names if n not in self.questions]
        if unknown:
            raise ValueError(f"questions {unknown}: this student answers only {sorted(self.questions)}")
        if isinstance(questions, dict):
            changed = [n for n in names if questions[n] != self.questions[n]]
            if changed:
                raise ValueError(f"questions {changed}: definition differs from the one this student was distilled for")
        if not names:
            raise ValueError(f"questions: empty; ask at least one of {sorted(self.questions)}")
        return names

    def predict(self, state: Any, questions: Any = None) -> dict[str, Any]:
        return self.predict_batch([state], questions)[0]

    def predict_batch(self, states: list[Any], questions: Any = None, *, batch_size: int = 32) -> list[dict[str, Any]]:
        if not isinstance(states, (list, tuple)):
            raise ValueError(f"states: expected a list, got {type(states).__name__}")
        if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
            raise ValueError(f"batch_size: must be a positive integer, got {batch_size!r}")
        names = self.select(questions)
        texts = [state_text(s) for s in states]
        if not texts:
            return []
        if self.kind == "encoder":
            logits, usage = self._run_encoder(texts, batch_size)
        else:
            logits, usage = self._run_linear(texts, batch_size)
        wanted = set(names)
        out = []
        for i in range(len(texts)):
            answers = {}
            for head in self._heads:
                if head["name"] not in wanted:
                    continue
                z = logits[i, head["offset"]:head["offset"] + head["size"]]
                answers[head["name"]] = answer_from_probs(head, softmax(z, head["temperature"]))
            u = dict(usage[i])
            u["truncated_questions"] = list(names) if u["truncated"] else []
            out.append({"model": f"student:{self.name}", "answers": {n: answers[n] for n in names}, "usage": u})
        return out

    def logits(self, states: list[Any]) -> np.ndarray:
        """Raw (uncalibrated) logits, all heads concatenated: what reports and calibration read."""
        texts = [state_text(s) for s in states]
        run = self._run_encoder if self.kind == "encoder" else self._run_linear
        return run(texts, 32)[0]

    def _run_encoder(self, texts: list[str], batch_size: int) -> tuple[np.ndarray, list[dict]]:
        assert self._tokenizer is not None
        usage: list[dict] = []
        ids: list[list[int]] = []
        for enc in self._tokenizer.encode_batch(texts):
            full = enc.ids
            kept = full if len(full) <= self.max_len else full[:self.max_len - 1] + full[-1:]
            ids.append(kept)
            dropped = len(full) - len(kept)
            usage.append({"input_tokens": len(kept), "output_tokens": 0, "state_tokens": len(full),
                          "state_tokens_dropped": dropped, "truncated": dropped > 0})
        by_len: dict[int, list[int]] = defaultdict(list)
        for i, row in enumerate(ids):
            by_len[len(row)].append(i)
        step = 1 if self.precision == "int8" else batch_size
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
        for start in range(0, len(texts), batch_size):
            chunk = np.array(prepare_text(texts[start:start + batch_size]), dtype=object).reshape(-1, 1)
            out[start:start + len(chunk)] = self._session.run(["logits"], {"text": chunk})[0]
        usage = [{"input_tokens": len(t.split()), "output_tokens": 0, "state_tokens": len(t.split()),
                  "state_tokens_dropped": 0, "truncated": False} for t in texts]
        return out, usage
