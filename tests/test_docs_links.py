"""The README is a guide that links into docs/: every relative link of README.md and docs/*.md resolves (the file
exists; a #anchor is a heading of the file it points into, as GitHub spells anchors), and the README stays a
guide's length."""
from __future__ import annotations

import os
import re

import pytest

ROOT = os.path.normpath(os.path.join(os.path.dirname(__file__), os.pardir))
PAGES = ["README.md"] + [os.path.join("docs", f) for f in sorted(os.listdir(os.path.join(ROOT, "docs")))
                         if f.endswith(".md")]
LINK = re.compile(r"!?\[(?:[^\]]|\][^(])*\]\(([^)\s]+)\)")


def anchor(heading: str) -> str:
    """GitHub's anchor of a heading: lower case, punctuation other than - and _ dropped, spaces as -."""
    text = re.sub(r"`|\*|_(?=\W)|(?<=\W)_", "", heading.strip().lower())
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


def anchors(page: str) -> set[str]:
    out, fenced = set(), False
    for line in open(os.path.join(ROOT, page), encoding="utf-8"):
        if line.startswith("```"):
            fenced = not fenced
        elif not fenced and re.match(r"#{1,6} ", line):
            out.add(anchor(line.lstrip("#")))
    return out


def links(page: str) -> list[str]:
    text = re.sub(r"```.*?```", "", open(os.path.join(ROOT, page), encoding="utf-8").read(), flags=re.S)
    return [m.group(1) for m in LINK.finditer(text) if not re.match(r"[a-z]+:", m.group(1))]


@pytest.mark.parametrize("page", PAGES)
def test_every_link_resolves(page):
    broken = []
    for target in links(page):
        path, _, frag = target.partition("#")
        dest = os.path.normpath(os.path.join(ROOT, os.path.dirname(page), path)) if path else os.path.join(ROOT, page)
        if not os.path.exists(dest):
            broken.append(f"{target}: no such file")
        elif frag and dest.endswith(".md") and frag not in anchors(os.path.relpath(dest, ROOT)):
            broken.append(f"{target}: no heading with that anchor")
    assert not broken, f"{page}: " + "; ".join(broken)


def test_the_search_finds_links_and_anchors():
    assert "docs/cli.md" in links("README.md") and "docs/demo-report.png" in links("README.md")
    assert anchor("The GPU check") == "the-gpu-check" and anchor("`onnxfuse` in *one* line") == "onnxfuse-in-one-line" and "the-gpu-check" in anchors("docs/benchmarks.md")


def test_the_readme_is_a_guide_not_a_lab_notebook():
    with open(os.path.join(ROOT, "README.md"), encoding="utf-8") as f:
        assert sum(1 for _ in f) <= 450
