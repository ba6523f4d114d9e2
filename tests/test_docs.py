"""The docs stay a results page with working links.

docs/benchmarks.md answers questions; how each number was found lives beside its run folder
(docs/bench/<topic>/README.md). These tests keep the page short and every relative link on it, and every
link into it or into the evidence READMEs, pointing at a file and heading that exist.
"""

import re
import unicodedata
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"
RESULTS = DOCS / "benchmarks.md"
MAX_LINES = 600

LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")
HEADING = re.compile(r"^(#{1,6})\s+(.*?)\s*#*\s*$")


def slug(heading):
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces to hyphens."""
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading).strip().lower()
    kept = []
    for ch in text:
        if ch == " ":
            kept.append("-")
        elif ch == "-" or unicodedata.category(ch)[0] in "LMN" or unicodedata.category(ch) == "Pc":
            kept.append(ch)
    return "".join(kept)


def anchors(path):
    """Every anchor a Markdown file defines (duplicate headings get -1, -2, ... as on GitHub)."""
    seen, result, fenced = {}, set(), False
    for line in path.read_text().splitlines():
        if line.startswith("```"):
            fenced = not fenced
            continue
        match = HEADING.match(line)
        if match and not fenced:
            base = slug(match.group(2))
            count = seen.get(base, 0)
            result.add(base if count == 0 else f"{base}-{count}")
            seen[base] = count + 1
    return result


def relative_links(path):
    """(line number, target) of every relative link in a Markdown file, outside code fences."""
    fenced = False
    for number, line in enumerate(path.read_text().splitlines(), 1):
        if line.startswith("```"):
            fenced = not fenced
            continue
        if fenced:
            continue
        for target in LINK.findall(line):
            if not re.match(r"^[a-z][a-z0-9+.-]*:", target):
                yield number, target


def broken_links(path, only_into=None, root=ROOT):
    """Links in `path` whose file or heading does not exist; `only_into`: check only links to these files."""
    problems = []
    for number, target in relative_links(path):
        file_part, _, fragment = target.partition("#")
        file = (path.parent / file_part).resolve() if file_part else path.resolve()
        if only_into is not None and file not in only_into:
            continue
        if not file.exists():
            problems.append(f"{path.relative_to(root)}:{number}: {target} (no such file)")
        elif fragment and file.suffix == ".md" and fragment not in anchors(file):
            problems.append(f"{path.relative_to(root)}:{number}: {target} (no such heading)")
    return problems


def evidence_readmes():
    return sorted(DOCS.glob("bench/*/README.md"))


def test_results_page_is_short():
    lines = RESULTS.read_text().splitlines()
    assert len(lines) <= MAX_LINES, (
        f"docs/benchmarks.md has {len(lines)} lines (at most {MAX_LINES}): keep the answers there and move how "
        "each number was found to the README beside its run folder (docs/bench/<topic>/README.md)"
    )


def test_every_relative_link_on_the_results_page_resolves():
    assert broken_links(RESULTS) == []


def test_every_link_in_the_evidence_readmes_resolves():
    problems = [p for readme in evidence_readmes() for p in broken_links(readme)]
    assert problems == []


def test_links_into_the_results_page_and_the_evidence_resolve():
    """Other docs that cite a section of the results page or of an evidence README find it there."""
    targets = {
        RESULTS.resolve(),
        (DOCS / "benchmarks-archive.md").resolve(),
        *(r.resolve() for r in evidence_readmes()),
    }
    sources = [ROOT / "README.md", *DOCS.glob("*.md"), DOCS / "bench" / "README.md"]
    problems = [p for source in sources for p in broken_links(source, only_into=targets)]
    assert problems == []


@pytest.mark.parametrize(
    "heading, anchor",
    [
        (
            "2026-12-06 (session 26): a CPU where the one-token decode is memory-bound — speculation beats llama.cpp",
            "2026-12-06-session-26-a-cpu-where-the-one-token-decode-is-memory-bound--speculation-beats-llamacpp",
        ),
        ("What `--batch-invariant` costs", "what---batch-invariant-costs"),
        ("Trees (issue 10): chain k = 4 vs trees", "trees-issue-10-chain-k--4-vs-trees"),
        ("`scripts/gpu_check.py` on one NVIDIA H200", "scriptsgpu_checkpy-on-one-nvidia-h200"),
    ],
)
def test_slug_matches_github(heading, anchor):
    assert slug(heading) == anchor


def test_a_missing_file_or_heading_is_reported(tmp_path):
    (tmp_path / "other.md").write_text("# Title\n\n## A section\n")
    page = tmp_path / "page.md"
    page.write_text(
        "[ok](other.md#a-section) [gone](missing.md) [no heading](other.md#nope) [here](#top)\n"
        "# Top\n```\n[in a fence](missing.md)\n```\n"
    )
    problems = broken_links(page, root=tmp_path)
    assert problems == ["page.md:1: missing.md (no such file)", "page.md:1: other.md#nope (no such heading)"]
