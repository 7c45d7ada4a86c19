"""One `pagoda distill` run walks distill's files in one direction (docs/distill.md, "How data flows").

Each stage's module imports only modules of earlier stages (and laya); only the two drivers, the CLI
and the pipeline that calls the stages in order, reach forward. laya never imports distill. Read from
the source (every import, top-level or inside a function), so a back edge fails here, not in review.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
WALK = ["task", "labels", "inputs", "modeling_student", "fidelity", "trainer", "linear", "export", "remote_teacher",
        "deferral", "questions", "student_folder", "runtime", "latency", "report"]
DRIVERS = ["cli", "pipeline"]
OUTSIDE = ["corpus"]   # `python -m distill.corpus`: writes make student's data file before the run


def _imports(path: Path) -> set[str]:
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module:
            out.add(node.module)
            if node.module == "distill":
                out |= {f"distill.{a.name}" for a in node.names}
    return out


def _distill_deps(name: str) -> set[str]:
    return {m.split(".")[1] for m in _imports(ROOT / "distill" / f"{name}.py")
            if m.startswith("distill.")}


def test_every_module_has_its_place_in_the_walk():
    modules = {p.stem for p in (ROOT / "distill").glob("*.py")} - {"__init__"}
    assert modules == set(WALK + DRIVERS + OUTSIDE)


def test_stages_import_only_earlier_stages():
    for i, name in enumerate(WALK):
        later = _distill_deps(name) - set(WALK[:i])
        assert not later, f"distill.{name} imports {sorted(later)}: later in the walk, or a driver"
    assert _distill_deps("corpus") == set()


def test_laya_knows_nothing_of_distill():
    for path in (ROOT / "laya").rglob("*.py"):
        assert not [m for m in _imports(path) if m.split(".")[0] == "distill"], path
