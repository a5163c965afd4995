"""Links between the docs resolve: every relative link names an existing file, and every
``#anchor`` into a Markdown page names a heading (GitHub's slug) or an explicit ``<a id>`` there.
``docs/index.md`` links the main pages, and every page under ``docs/`` can be reached from it.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
PAGES = sorted([REPO / "README.md", REPO / "CONTRIBUTING.md", *(REPO / "docs").rglob("*.md")])
_LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")
_FENCE = re.compile(r"^```.*?^```", re.S | re.M)


def _slug(heading: str) -> str:
    """GitHub's heading anchor: lower case, punctuation dropped, spaces to hyphens."""
    text = re.sub(r"<[^>]+>", "", heading).strip().lower()
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


def _anchors(page: Path) -> set[str]:
    text = _FENCE.sub("", page.read_text(encoding="utf-8"))
    headings = {_slug(m) for m in re.findall(r"^#{1,6} (.+)$", text, re.M)}
    return headings | set(re.findall(r'<a id="([^"]+)"', text))


def _links(page: Path) -> list[str]:
    text = _FENCE.sub("", page.read_text(encoding="utf-8"))
    return [link for link in _LINK.findall(text) if not re.match(r"[a-z]+:", link)]


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(REPO)))
def test_relative_links_resolve(page: Path) -> None:
    broken = []
    for link in _links(page):
        path, _, anchor = link.partition("#")
        target = (page.parent / path).resolve() if path else page
        if not target.exists():
            broken.append(f"{link} (no file {target})")
        elif anchor and target.suffix == ".md" and anchor not in _anchors(target):
            broken.append(f"{link} (no anchor #{anchor} in {target.name})")
    assert not broken, f"{page.relative_to(REPO)}: broken links: {broken}"


def test_index_links_the_main_pages() -> None:
    linked = {link.partition("#")[0] for link in _links(REPO / "docs" / "index.md")}
    required = {"quickstart.md", "api.md", "reference/api.md", "sdk.md", "configuration.md",
                "architecture.md", "benchmarks.md"}
    assert required <= linked, f"docs/index.md does not link {sorted(required - linked)}"


def test_every_page_is_reachable_from_the_index() -> None:
    """No orphan page: following links from docs/index.md reaches every page under docs/."""
    seen, todo = set(), [(REPO / "docs" / "index.md").resolve()]
    while todo:
        page = todo.pop()
        if page in seen or page.suffix != ".md" or not page.exists():
            continue
        seen.add(page)
        todo += [(page.parent / link.partition("#")[0]).resolve() for link in _links(page)
                 if link.partition("#")[0]]
    orphans = sorted(str(p.relative_to(REPO)) for p in (REPO / "docs").rglob("*.md")
                     if p.resolve() not in seen)
    assert not orphans, f"pages no link from docs/index.md leads to: {orphans}"
