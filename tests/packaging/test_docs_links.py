"""Every relative link in the project's Markdown resolves: the file exists and, where a `#fragment` is given, the
target has a heading with that anchor (GitHub's rule: lower case, punctuation dropped, spaces to hyphens).

Why a test: the docs link into each other's sections by anchor, and sections move (the laya-mini card's record went
to docs/laya-mini-log.md); a heading renamed or moved breaks links silently, and GitHub renders them without
complaint."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
LINK = re.compile(r"\]\(([^()\s#]*)(#[^()\s]+)?\)")


def _slug(heading: str) -> str:
    text = heading.lstrip("#").strip().lower()
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


def _anchors(path: Path) -> set[str]:
    anchors, fenced = set(), False
    for line in path.read_text(encoding="utf-8").splitlines():
        if line.startswith("```"):
            fenced = not fenced
        elif not fenced and line.startswith("#"):
            anchors.add(_slug(line))
    return anchors


def broken_links(files: list[Path], root: Path = ROOT) -> list[str]:
    """'file: target' for each relative link whose file or anchor does not exist."""
    cache: dict[Path, set[str]] = {}
    broken = []
    for md in files:
        for match in LINK.finditer(md.read_text(encoding="utf-8")):
            target, fragment = match.group(1), match.group(2)
            if target.startswith(("http://", "https://", "mailto:")):
                continue
            path = (md.parent / target).resolve() if target else md.resolve()
            if not path.exists():
                broken.append(f"{md.relative_to(root)}: {target}")
            elif fragment and path.suffix == ".md":
                if fragment[1:] not in cache.setdefault(path, _anchors(path)):
                    broken.append(f"{md.relative_to(root)}: {target}{fragment}")
    return broken


def _project_markdown() -> list[Path]:
    return sorted([*ROOT.glob("*.md"), *ROOT.glob("docs/*.md"), *ROOT.glob("datasets/*.md")])


def test_project_links_resolve():
    files = _project_markdown()
    assert len(files) > 10
    assert broken_links(files) == []


def test_a_moved_section_is_caught(tmp_path):
    (tmp_path / "card.md").write_text("# Card\n\n## Known limits\n\nSee [log](log.md#round-6) and [x](#known-limits).\n")
    (tmp_path / "log.md").write_text("# Log\n\n```\n# Round 6 in a code block\n```\n## Round 7\n")
    assert broken_links([tmp_path / "card.md"], tmp_path) == ["card.md: log.md#round-6"]
    (tmp_path / "log.md").write_text("# Log\n\n## Round 6\n")
    assert broken_links([tmp_path / "card.md"], tmp_path) == []
    (tmp_path / "card.md").write_text("[gone](missing.md)\n")
    assert broken_links([tmp_path / "card.md"], tmp_path) == ["card.md: missing.md"]
