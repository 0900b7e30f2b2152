"""Every relative link and image in the repository's Markdown points at a file that is there, and the two indexes
(`docs/README.md`, `benchmarks/results/README.md`) list everything in their folders."""

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)")
FENCE = re.compile(r"```.*?```", re.S)
SKIP = {".git", ".venv", ".venv-releases", "build", "dist", "node_modules", ".pytest_cache"}


def markdown_files() -> list[Path]:
    return sorted(
        p
        for p in ROOT.rglob("*.md")
        if not SKIP & set(p.relative_to(ROOT).parts) and "egg-info" not in str(p)
    )


def relative_links(path: Path) -> list[str]:
    text = FENCE.sub("", path.read_text(encoding="utf-8"))
    links = [m.group(1) for m in LINK.finditer(text)]
    return [link for link in links if not re.match(r"^[a-z][a-z0-9+.-]*:", link) and not link.startswith("#")]


@pytest.mark.parametrize("path", markdown_files(), ids=lambda p: str(p.relative_to(ROOT)))
def test_relative_links_resolve(path):
    dead = [link for link in relative_links(path) if not (path.parent / link.split("#")[0]).exists()]
    assert not dead, f"{path.relative_to(ROOT)} links to missing files: {dead}"


def test_a_dead_link_is_caught(tmp_path):
    page = tmp_path / "page.md"
    page.write_text(
        "[ok](page.md) ![gone](plot.png) [web](https://example.org) [anchor](#x)\n```\n[code](no.md)\n```"
    )
    assert relative_links(page) == ["page.md", "plot.png"]
    assert not (page.parent / "plot.png").exists()


@pytest.mark.parametrize("folder", ["docs", "benchmarks/results"])
def test_the_indexes_list_everything_in_their_folder(folder):
    index = ROOT / folder / "README.md"
    listed = {(index.parent / link.split("#")[0]).resolve() for link in relative_links(index)}
    entries = [p for p in (ROOT / folder).iterdir() if p.name != "README.md" and not p.name.startswith(".")]
    missing = []
    for entry in entries:
        stem = entry.with_suffix(".md") if entry.suffix == ".json" else entry  # a table's JSON is its .md's
        if entry.resolve() not in listed and stem.resolve() not in listed:
            missing.append(entry.name)
    assert not missing, f"{index.relative_to(ROOT)} does not list {sorted(missing)}"
