"""The project's documents stand on their own: no path outside the repository, every relative link resolves."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DOCS = [ROOT / "README.md", ROOT / "DEVELOPERS.md", *sorted((ROOT / "docs").glob("**/*.md"))]
LINK = re.compile(r"\]\(([^)#\s]+)(?:#[^)]*)?\)")  # [text](target) with a relative target


def test_documents_name_nothing_outside_the_repository() -> None:
    outside = {str(p.relative_to(ROOT)): n for p in DOCS if (n := p.read_text(encoding="utf-8").count("../"))}
    assert outside == {}


def test_every_relative_link_resolves_inside_the_repository() -> None:
    broken = []
    for doc in DOCS:
        for target in LINK.findall(doc.read_text(encoding="utf-8")):
            if re.match(r"[a-z]+:", target):  # https:, mailto:
                continue
            path = (doc.parent / target).resolve()
            if not path.exists() or not path.is_relative_to(ROOT):
                broken.append(f"{doc.relative_to(ROOT)} -> {target}")
    assert broken == []


def test_readme_links_the_architecture_document_which_covers_every_folder() -> None:
    assert "](docs/architecture.md)" in (ROOT / "README.md").read_text(encoding="utf-8")
    architecture = (ROOT / "docs" / "architecture.md").read_text(encoding="utf-8")
    folders = [p.name for p in ROOT.iterdir() if p.is_dir() and (p / "__init__.py").exists()]
    assert sorted(folders) == ["harness", "recipes", "sandbox", "tasks", "trainers"]
    assert all(f"`{name}/`" in architecture for name in folders)
    for section in ("## The seams", "## Flow of `harness run`", "## Flow of `harness eval`", "## Results store", "## The episode contract"):
        assert section in architecture
