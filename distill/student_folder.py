"""What a student folder holds (`student.json`, its ONNX models, `tokenizer.json`), read and checked in one place.

Why its own module: a server reads a student's questions and models before any worker loads it, in a process that
must not import onnxruntime (its import starts a native thread a forked worker would inherit without the thread),
so this reads the folder with json alone; `distill.runtime.Student` reads it the same way. A folder that is not a
student's, or a student.json a hand edit broke, is refused naming the file and the field (the server had shown a
KeyError traceback, or a tokenizer's bare "No such file or directory", or answered 500 to every request).
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

FORMAT = "pagoda-student/1"
REQUIRED = {"name": str, "kind": str, "questions": dict, "heads": list, "models": dict, "default_precision": str,
            "max_len": int}
KINDS = ("encoder", "linear")


def read_meta(folder: str | os.PathLike) -> dict[str, Any]:
    """The folder's student.json, checked: its format, the fields every reader uses, a head per question, the
    model files it names and, for an encoder student, its tokenizer."""
    folder = Path(folder)
    path = folder / "student.json"
    if not path.is_file():
        raise FileNotFoundError(f"{folder}: not a student folder (no student.json)")
    try:
        meta = json.loads(path.read_text(encoding="utf-8"))
    except (ValueError, UnicodeDecodeError) as exc:
        raise ValueError(f"{path}: not valid JSON ({exc})") from None
    if not isinstance(meta, dict):
        raise ValueError(f"{path}: must hold a JSON object, got {type(meta).__name__}")
    if meta.get("format") != FORMAT:
        raise ValueError(f"{path}: field 'format' is {meta.get('format')!r}, expected {FORMAT!r}")
    for name, kind in REQUIRED.items():
        value = meta.get(name)
        if isinstance(value, bool) or not isinstance(value, kind) or (kind is not int and not value):
            raise ValueError(f"{path}: field {name!r} must be a non-empty {kind.__name__}, got {value!r:.60}")
    if meta["kind"] not in KINDS:
        raise ValueError(f"{path}: field 'kind' must be one of {', '.join(KINDS)}, got {meta['kind']!r}")
    heads = {h.get("name") for h in meta["heads"] if isinstance(h, dict)}
    missing = [q for q in meta["questions"] if q not in heads]
    if missing:
        raise ValueError(f"{path}: field 'heads' has no head for question(s) {', '.join(missing)}")
    if meta["default_precision"] not in meta["models"]:
        raise ValueError(f"{path}: field 'default_precision' is {meta['default_precision']!r}, not one of its "
                         f"models ({', '.join(sorted(meta['models']))})")
    needed = [str(f) for f in meta["models"].values()] + (["tokenizer.json"] if meta["kind"] == "encoder" else [])
    absent = [f for f in needed if not (folder / f).is_file()]
    if absent:
        raise FileNotFoundError(f"{folder}: student files missing: {', '.join(absent)}")
    return meta
