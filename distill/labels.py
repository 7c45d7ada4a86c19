"""Teacher labelling: calibrated probabilities for every row, on disk as Parquet, resumable and shardable.

The corpus is cut into fixed chunks of `labels.chunk_rows` rows by global row index. A chunk is
labelled with one batched `datasets.map` and written atomically as `labels/chunk-NNNNN.parquet`,
so an interrupted run resumes at the first missing chunk without relabelling finished rows.
Shard `i/n` labels the chunks `c` with `c % n == i`; because chunk files are named by position,
not by shard, labelling one corpus on many machines is copying their `labels/` folders together.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import Any, Protocol

import numpy as np

from distill.task import Task
from laya.answers import probabilities_from_answer
from laya.checks import check_utf8
from laya.rows import state_text

ROW = "__row__"


class Teacher(Protocol):
    def predict_batch(self, states: list[Any], questions: Any, *, batch_size: int = 32,
                      **budgets: Any) -> list[dict[str, Any]]: ...


def prob_column(question: str) -> str:
    return f"p.{question}"


def _blank(path: Path) -> bool:
    with open(path, "rb") as f:
        return not any(block.strip() for block in iter(lambda: f.read(1 << 16), b""))


def load_corpus(path: str | os.PathLike, task: Task, flag: str = "--data"):
    """The data file as a `datasets.Dataset` with a global row index; json/jsonl/csv/parquet.

    `flag` names the file in every error about it. `datasets` met an empty file with a
    StopIteration traceback, a blank one, a header-only CSV or `[]` with "Instruction 'train' corresponds to no
    data!", a CSV not in UTF-8 with a traceback, and a JSON file not in UTF-8 only at the row it read."""
    from datasets import Dataset

    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"{flag}: {path} does not exist")
    readers = {".jsonl": Dataset.from_json, ".json": Dataset.from_json, ".csv": Dataset.from_csv,
               ".parquet": Dataset.from_parquet}
    suffix = path.suffix.lower()
    if suffix not in readers:
        raise ValueError(f"{flag}: {path} has an unknown format {suffix!r}; use .jsonl, .json, .csv or .parquet")
    empty = ValueError(f"{flag}: {path} holds no rows")
    if _blank(path):
        raise empty
    if suffix != ".parquet":  # datasets' JSON reader keeps bytes that are not UTF-8 and fails on the row later
        check_utf8(path, flag)
    try:
        ds = readers[suffix](str(path))
    except ValueError as exc:
        if "corresponds to no data" in str(exc):
            raise empty from None
        raise
    if len(ds) == 0:
        raise empty
    if task.text_field not in ds.column_names:
        raise ValueError(f"task.text_field: column {task.text_field!r} is not in {path} (columns: {ds.column_names})")
    for q, col in task.gold.items():
        if col not in ds.column_names:
            raise ValueError(f"task.gold.{q}: column {col!r} is not in {path}")
    if task.labels.max_rows:
        ds = ds.select(range(min(len(ds), task.labels.max_rows)))
    return ds.add_column(ROW, list(range(len(ds))))


def parse_shard(text: str | None) -> tuple[int, int]:
    if not text:
        return 0, 1
    try:
        i, n = (int(x) for x in text.split("/"))
    except ValueError:
        raise ValueError(f"shard: expected I/N such as 0/4, got {text!r}") from None
    if not (n >= 1 and 0 <= i < n):
        raise ValueError(f"shard: need 0 <= I < N, got {text!r}")
    return i, n


def _chunk_path(label_dir: Path, c: int) -> Path:
    return label_dir / f"chunk-{c:05d}.parquet"


def _data_fingerprint(corpus, task: Task) -> str:
    h = hashlib.sha256()
    for text in corpus[task.text_field]:
        h.update(state_text(text).encode())
        h.update(b"\0")
    return h.hexdigest()[:16]


def _check_meta(label_dir: Path, task: Task, corpus, teacher_id: str) -> None:
    """Chunks from another task, corpus size or teacher must never be mixed into these labels."""
    meta = {"task": task.fingerprint(), "rows": len(corpus), "chunk_rows": task.labels.chunk_rows,
            "teacher": teacher_id, "data": _data_fingerprint(corpus, task)}
    path = label_dir / "meta.json"
    # a meta.json beside no chunk (a run that failed before its first) holds nothing to mix: rewrite it
    if path.exists() and any(label_dir.glob("chunk-*.parquet")):
        old = json.loads(path.read_text())
        if old != meta:
            diff = sorted(k for k in meta if old.get(k) != meta[k])
            raise ValueError(f"{label_dir}: existing labels were made with different {diff}; use a new --out or delete it")
    else:
        label_dir.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(meta, indent=1))


def label(task: Task, teacher: Teacher, corpus, label_dir: Path, *, shard: tuple[int, int] = (0, 1),
          teacher_id: str = "", progress: bool = True) -> int:
    """Label this shard's missing chunks; returns how many rows were labelled now (0: all were done)."""
    from datasets.utils.logging import disable_progress_bar
    from tqdm.auto import tqdm

    disable_progress_bar()  # our bar counts rows across chunks; one bar per chunk would be noise
    label_dir = Path(label_dir)
    _check_meta(label_dir, task, corpus, teacher_id)
    size = task.labels.chunk_rows
    i, n = shard
    chunks = [c for c in range(-(-len(corpus) // size)) if c % n == i]
    todo = [c for c in chunks if not _chunk_path(label_dir, c).exists()]
    total = sum(min(size, len(corpus) - c * size) for c in chunks)
    done_rows = total - sum(min(size, len(corpus) - c * size) for c in todo)

    def label_batch(batch: dict[str, list]) -> dict[str, list]:
        states = [state_text(s) for s in batch[task.text_field]]
        answers = teacher.predict_batch(states, task.questions, batch_size=task.labels.batch_size, **task.budgets)
        out: dict[str, list] = {}
        for name, q in task.parsed.items():
            out[prob_column(name)] = [
                probabilities_from_answer(q, a["answers"][name]).astype(np.float32).tolist() for a in answers]
        bar.update(len(states))
        return out

    with tqdm(total=total, initial=done_rows, desc=f"label {i}/{n}", unit="row", disable=not progress) as bar:
        for c in todo:
            part = corpus.select(range(c * size, min(len(corpus), (c + 1) * size)))
            part = part.map(label_batch, batched=True, batch_size=task.labels.batch_size,
                            load_from_cache_file=False, keep_in_memory=True)
            final = _chunk_path(label_dir, c)
            tmp = final.with_suffix(".tmp")
            part.to_parquet(str(tmp))
            os.replace(tmp, final)  # a chunk exists only once it is complete
    return total - done_rows


def missing_chunks(label_dir: Path, n_rows: int, chunk_rows: int) -> list[int]:
    return [c for c in range(-(-n_rows // chunk_rows)) if not _chunk_path(Path(label_dir), c).exists()]


def load_labels(label_dir: Path):
    """Every labelled chunk as one Dataset in row order; refuses a partial set (name the missing chunks)."""
    from datasets import Dataset

    label_dir = Path(label_dir)
    meta = json.loads((label_dir / "meta.json").read_text())
    missing = missing_chunks(label_dir, meta["rows"], meta["chunk_rows"])
    if missing:
        raise ValueError(f"labels in {label_dir} are incomplete: chunks {missing[:10]} missing (label the remaining shards first)")
    files = [str(_chunk_path(label_dir, c)) for c in range(-(-meta["rows"] // meta["chunk_rows"]))]
    return Dataset.from_parquet(files, keep_in_memory=True)


def split_of(rows: np.ndarray, task: Task) -> np.ndarray:
    """0 train, 1 validation, 2 held-out: a pure function of (row, seed), so every machine agrees."""
    rng = np.random.default_rng(task.split.seed)
    u = rng.random(int(rows.max()) + 1 if len(rows) else 0)[rows]
    out = np.zeros(len(rows), dtype=np.int8)
    out[u < task.split.holdout + task.split.validation] = 1
    out[u < task.split.holdout] = 2
    return out


def targets(ds, task: Task) -> dict[str, np.ndarray]:
    """Per question, the teacher's distributions as an (n, k) float array."""
    return {name: np.asarray(ds[prob_column(name)], dtype=np.float64) for name in task.questions}


def gold_indices(ds, task: Task) -> dict[str, np.ndarray]:
    """Per question with a gold column, the gold option index (-1 where the value is not an option)."""
    out = {}
    for name, col in task.gold.items():
        q = task.parsed[name]
        idx = []
        for v in ds[col]:
            if v is None:   # a row without gold (e.g. a real utterance in the corpus): not scored against gold
                idx.append(-1)
                continue
            if q.type == "noul":
                v = "true" if v in (True, 1, "true", "True", "yes") else "false"
            elif q.type == "score":
                v = int(v)
            idx.append(q.keys.index(v) if v in q.keys else -1)
        out[name] = np.asarray(idx)
    return out
