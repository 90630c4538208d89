"""The docs stay usable: a short README that opens with the set-up commands, links that resolve,
and a checks reference that covers every finding kind."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from fsdpcheck.vocab import FindingKind

REPO = Path(__file__).resolve().parents[2]
README = REPO / "README.md"
DOCS = sorted((REPO / "docs").glob("*.md"))
MAX_README_WORDS = 2000

FENCE = re.compile(r"^```.*?^```", re.S | re.M)
LINK = re.compile(r"\]\(([^)\s]+)\)")  # [text](target)
SCHEME = re.compile(r"^[a-z][a-z0-9+.-]*:", re.I)  # https:, mailto:, …
# A repository path a page names in prose or code: `scripts/bench/workers/rss.py`, `tests/ranks/`.
CITED_PATH = re.compile(r"(?<![\w/.-])((?:fsdpcheck|scripts|tests|examples|docs)/[\w/.-]*[\w/])")


def relative_links(path: Path) -> list[str]:
    """The link targets outside code blocks that point into the repository (anchors dropped)."""
    prose = FENCE.sub("", path.read_text())
    targets = (m.group(1) for m in LINK.finditer(prose))
    return [t.partition("#")[0] for t in targets if not SCHEME.match(t) and not t.startswith("#")]


def test_readme_is_short():
    words = len(README.read_text().split())  # as `wc -w` counts
    assert words <= MAX_README_WORDS, f"README.md has {words} words (at most {MAX_README_WORDS})"


def test_readme_starts_with_the_two_setup_commands():
    lines = README.read_text().splitlines()
    assert lines[0] == "# fsdpcheck"
    block = lines[lines.index("```") : lines.index("```") + 4]
    assert block[0] == "```" and block[3] == "```", block
    assert block[1].startswith("make demo ") and "#" in block[1]
    assert block[2].startswith("make test ") and "#" in block[2]
    first_prose = next(line for line in lines[lines.index("```") + 4 :] if line.strip())
    assert first_prose.startswith("Both need only Python")


@pytest.mark.parametrize("path", [README, *DOCS], ids=lambda p: p.relative_to(REPO).as_posix())
def test_every_relative_link_points_at_a_file(path: Path):
    missing = [t for t in relative_links(path) if not (path.parent / t).exists()]
    assert missing == [], f"{path.relative_to(REPO)} links to files that do not exist"


def cited_paths(path: Path) -> list[str]:
    """Every repository path ``path`` names, code blocks included (a command cites a script)."""
    return [m.group(1).rstrip(".") for m in CITED_PATH.finditer(path.read_text())]


# The changelog is history: it names files as they were when the change was made.
@pytest.mark.parametrize("path", [README, *DOCS], ids=lambda p: p.relative_to(REPO).as_posix())
def test_every_path_a_page_cites_exists(path: Path):
    missing = sorted({t for t in cited_paths(path) if not (REPO / t).exists()})
    assert missing == [], f"{path.relative_to(REPO)} cites paths that do not exist"


def test_the_path_finder_sees_paths_in_prose_and_code(tmp_path: Path):
    page = tmp_path / "page.md"
    page.write_text(
        "Run scripts/bench (`scripts/bench/workers/rss.py`, tests/ranks/).\n"
        "```\npython scripts/loader_matrix.py\n```\nnot a path: my_scripts/x.py, a/tests/b.py\n"
    )
    assert cited_paths(page) == [
        "scripts/bench",
        "scripts/bench/workers/rss.py",
        "tests/ranks/",
        "scripts/loader_matrix.py",
    ]


def test_the_link_finder_sees_links_and_skips_code(tmp_path: Path):
    page = tmp_path / "page.md"
    page.write_text(
        "See [a](a.md#part), [web](https://example.com) and [here](#top).\n"
        "```\n[not a link](nowhere.md)\n```\n"
    )
    assert relative_links(page) == ["a.md"]


def test_checks_reference_has_a_heading_for_every_finding_kind():
    text = (REPO / "docs" / "checks.md").read_text()
    headings = " ".join(re.findall(r"^#+ .*$", text, re.M))
    assert [k.value for k in FindingKind if f"`{k.value}`" not in headings] == []
