"""The demo on real data: the sweep learns (accuracies far above the 10% chance level)."""
from __future__ import annotations

import json

from onnxfuse.cli.demo import run_demo
from onnxfuse.runtime._machine import cpu_description


def test_demo_models_learn(tmp_path, capsys):
    rows = run_demo(str(tmp_path / "demo"), models=8, steps=80, progress=False)
    out = capsys.readouterr().out
    assert "test accuracy" in out and len(rows) == 8
    assert f"trained on {cpu_description()}" in out  # the table says which CPU it comes from, and so does the report
    assert cpu_description() in json.loads((tmp_path / "demo" / "array" / "report.json").read_text())["note"]
    good = [r for r in rows if r["lr"] in (0.01, 0.03, 0.1)]
    assert all(r["test_accuracy"] > 0.85 for r in good), rows
    assert (tmp_path / "demo" / "models" / "model_7.safetensors").exists()
    assert (tmp_path / "demo" / "array" / "report.png").exists()  # the curves, the held-out digits evaluated too
