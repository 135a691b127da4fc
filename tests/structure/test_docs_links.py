"""The README is a guide that links into docs/: every relative link of README.md and docs/*.md resolves (the file
exists; a #anchor is a heading of the file it points into, as GitHub spells anchors), the README stays a guide's
length, and its end-to-end block runs as a reader pastes it."""
from __future__ import annotations

import os
import re

import pytest

from tests.conftest import ROOT

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


def readme_end_to_end() -> str:
    """The shell block of the README's "Your own model, end to end", as a reader pastes it."""
    text = open(os.path.join(ROOT, "README.md"), encoding="utf-8").read()
    section = text.split("## Your own model, end to end", 1)[1]
    return re.search(r"```sh\n(.*?)```", section, re.S).group(1)


def test_the_readme_end_to_end_block_runs_as_pasted(tmp_path):
    """The block run by bash (-e: any failing line fails it) in an empty folder, the installed commands and this
    Python first on PATH, every line as written but two numbers: 40 steps, evaluating every 20 (not 500 and 50:
    time). Then each split model is a zoo.LeNet state_dict (strict) in the state that ranked it, and report.png's
    eval panels hold several evaluations per model."""
    import json
    import subprocess
    import sys

    import torch
    from safetensors import safe_open
    from safetensors.numpy import load_file

    from onnxfuse.exporters import zoo

    block = readme_end_to_end()
    assert not re.search(r"\[--|\w\|\w", block)  # no optional [--flag], no choice a|b: nothing to edit
    short = block.replace("--steps 500", "--steps 40").replace("--eval-every 50", "--eval-every 20")
    assert short != block and short.count("--steps 40") == 1 and short.count("--eval-every 20") == 1
    env = {**os.environ, "PATH": os.path.dirname(sys.executable) + os.pathsep + os.environ["PATH"]}
    proc = subprocess.run(["bash", "-e", "-c", short], cwd=tmp_path, env=env, capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads((tmp_path / "array" / "report.json").read_text())
    eval_loss = next(p for p in report["panels"] if p["name"] == "eval_loss")
    assert [c["points"] for c in eval_loss["curves"]] == [2] * 4  # steps 20 and 40
    for m in report["models"]:
        b = m["model"]
        path = str(tmp_path / "models" / f"model_{b}.safetensors")
        zoo.LeNet().load_state_dict({k: torch.from_numpy(v.copy()) for k, v in load_file(path).items()}, strict=True)
        with safe_open(path, "np") as f:
            assert f.metadata()["onnxfuse.state"] == m["state"] == "best"
    assert (tmp_path / "models" / "model_3.onnx").is_file() and (tmp_path / "array" / "report.png").is_file()
