"""The package's shape: `generation/` imports form a DAG and stay inside their lane.

Every import counts, at module level, inside functions and under TYPE_CHECKING, because a cycle through
a lazy import is still a cycle to the reader (and to import-linter's graph)."""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[2] / "generation"


def module_name(path: Path) -> str:
    rel = path.relative_to(PACKAGE.parent).with_suffix("")
    parts = rel.parts[:-1] if rel.name == "__init__" else rel.parts
    return ".".join(parts)


def imported(path: Path) -> set[str]:
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.add(node.module)
            names |= {f"{node.module}.{a.name}" for a in node.names}  # `from generation import engine`
    return names


def graph() -> dict[str, set[str]]:
    files = {module_name(p): p for p in PACKAGE.rglob("*.py")}
    return {m: {n for n in imported(p) if n in files and n != m} for m, p in files.items()}


def find_cycle(edges: dict[str, set[str]]) -> list[str] | None:
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(m: str) -> list[str] | None:
        state[m] = 1
        stack.append(m)
        for n in sorted(edges[m]):
            if state.get(n) == 1:
                return stack[stack.index(n):] + [n]
            if n not in state and (found := visit(n)):
                return found
        stack.pop()
        state[m] = 2
        return None

    for m in sorted(edges):
        if m not in state and (found := visit(m)):
            return found
    return None


def test_generation_imports_form_a_dag():
    edges = graph()
    assert "generation.engine" in edges and "generation.attention" in edges["generation.modeling_llama"]
    assert find_cycle(edges) is None, " -> ".join(find_cycle(edges))


def test_cycle_finder_finds_a_cycle():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]


def test_generation_knows_nothing_of_laya_or_serving():
    for path in PACKAGE.rglob("*.py"):
        outside = {n.split(".")[0] for n in imported(path)} & {"laya", "serving", "distill"}
        assert not outside, f"{path.name} imports {outside}"


def test_the_model_file_holds_only_the_architecture():
    """Paged and cascade attention are the attention layer's; the model file calls it and nothing below it."""
    source = (PACKAGE / "modeling_llama.py").read_text()
    assert "scaled_dot_product_attention" not in source and "index_copy_" not in source
    assert graph()["generation.modeling_llama"] == {"generation.attention"}
