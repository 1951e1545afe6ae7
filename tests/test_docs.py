"""The README is a front page and docs/ holds the rest: the README stays small, links every topic
page, and no page links to what is not there or has prose lines too long to read in a terminal."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
MAX_README_BYTES = 20 * 1024
MAX_LINE = 120
TOPIC_PAGES = (
    "config",
    "stages",
    "parallelism",
    "planner",
    "cluster",
    "observability",
    "store",
    "reliability",
    "benchmarks",
    "design",
)
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")


def _pages() -> list[Path]:
    return [README, *sorted((ROOT / "docs").glob("*.md"))]


def _prose(text: str) -> list[tuple[int, str]]:
    """(line number, line) of every line outside fenced code blocks."""
    lines, fenced = [], False
    for number, line in enumerate(text.splitlines(), 1):
        if line.lstrip().startswith("```"):
            fenced = not fenced
            continue
        if not fenced:
            lines.append((number, line))
    return lines


def _slug(heading: str) -> str:
    """The anchor GitHub gives a heading: lower case, punctuation dropped, spaces to hyphens."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def _anchors(page: Path) -> set[str]:
    seen: dict[str, int] = {}
    anchors = set()
    for _, line in _prose(page.read_text()):
        if match := re.match(r"#{1,6} (.+)$", line):
            slug = _slug(match.group(1))
            anchors.add(f"{slug}-{seen[slug]}" if slug in seen else slug)
            seen[slug] = seen.get(slug, 0) + 1
    return anchors


def _links(page: Path) -> list[str]:
    """Every link target on the page, outside code blocks and code spans."""
    text = "\n".join(line for _, line in _prose(page.read_text()))
    return LINK.findall(re.sub(r"`[^`\n]*`", "", text))


def test_the_readme_is_a_front_page():
    size = len(README.read_bytes())
    assert size <= MAX_README_BYTES, f"README.md is {size} bytes, over {MAX_README_BYTES}: move detail to docs/"


@pytest.mark.parametrize("name", TOPIC_PAGES)
def test_every_topic_page_exists_and_the_readme_links_it(name):
    assert (ROOT / "docs" / f"{name}.md").is_file(), f"docs/{name}.md is missing"
    assert f"docs/{name}.md" in _links(README), f"README.md does not link docs/{name}.md"


@pytest.mark.parametrize("page", _pages(), ids=lambda p: str(p.relative_to(ROOT)))
def test_every_relative_link_resolves(page):
    broken = []
    for target in _links(page):
        if re.match(r"[a-z][a-z0-9+.-]*:", target):  # http:, https:, mailto:
            continue
        path, _, anchor = target.partition("#")
        linked = (page.parent / path).resolve() if path else page
        if not linked.exists():
            broken.append(target)
        elif anchor and linked.suffix == ".md" and anchor not in _anchors(linked):
            broken.append(f"{target} (no such heading)")
    assert not broken, f"{page.relative_to(ROOT)} links to what is not there: {broken}"


@pytest.mark.parametrize("page", _pages(), ids=lambda p: str(p.relative_to(ROOT)))
def test_no_prose_line_is_over_the_limit(page):
    """Code blocks are exempt everywhere; table rows only under docs/ (a topic page's table may
    hold a sentence a cell), so the README's tables keep one-line cells."""
    long = [
        f"{number}: {line[:60]}..."
        for number, line in _prose(page.read_text())
        if len(line) > MAX_LINE and not (page != README and line.lstrip().startswith("|"))
    ]
    assert not long, f"{page.relative_to(ROOT)} has lines over {MAX_LINE} characters: {long}"


def test_ci_runs_the_readmes_test_command():
    """CI calls the test command the README gives; the README keeps it as `make test`."""
    block = README.read_text().split("## The two commands", 1)[1].split("```", 2)[1]
    commands = [line.split("#")[0].strip() for line in block.splitlines()[1:] if line.strip()]
    assert commands == ["make run", "make test"], commands
    assert "make test" in (ROOT / ".ci" / "run").read_text().splitlines()
