"""`onnxfuse bench` writes its four files with every mode measured; it does not judge speed (a benchmark's
figures belong in the README, not in a test on a shared machine)."""
from __future__ import annotations

import csv
import json
import math

from onnxfuse.cli import main


def test_bench_writes_json_csv_md_and_png(tmp_path, capsys):
    out = tmp_path / "bench"
    modes = ["torch", "seq-torch", "dense"]
    assert main(["bench", "--models", "lenet", "--B", "1,2", "--steps", "1", "--rounds", "1", "--warmup", "0",
                 "--modes", ",".join(modes), "-o", str(out)]) == 0
    assert capsys.readouterr().out.count("lenet B=") == 2  # a progress line per measurement

    result = json.loads((out / "bench.json").read_text())
    assert result["modes"] == modes and [(r["model"], r["B"]) for r in result["rows"]] == [("lenet", 1), ("lenet", 2)]
    for row in result["rows"]:
        for mode in modes:
            m = row["modes"][mode]
            assert m["samples_s"] > 0 and math.isfinite(m["over_seq_torch"]) and m["of_dense"] > 0, (mode, m)
        assert row["modes"]["seq-torch"]["over_seq_torch"] == 1.0 and row["modes"]["dense"]["of_dense"] == 1.0
        assert row["peak_mib"] > 0

    with open(out / "bench.csv", newline="") as f:
        rows = list(csv.DictReader(f))
    assert [(r["model"], r["B"]) for r in rows] == [("lenet", "1"), ("lenet", "2")]
    assert all(float(r[f"{m} samples_s"]) > 0 for r in rows for m in modes)

    md = (out / "bench.md").read_text()
    assert result["command"] in md and "onnxfuse bench --models lenet --B 1,2" in md
    assert md.count("| lenet |") == 2 * len(modes)
    assert (out / "bench.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_bench_rejects_an_unknown_mode_with_the_choices(tmp_path, capsys):
    assert main(["bench", "--models", "lenet", "--modes", "torch,fast", "-o", str(tmp_path)]) != 0
    err = capsys.readouterr().err
    assert "unknown mode 'fast'" in err and "seq-torch" in err
