"""`onnxfuse report`: summary, plot and report.json from a synthetic metrics.csv (a diverged and a dropped model)
and from a real training run; bad folders are one-line errors."""
from __future__ import annotations

import csv
import json
import math

import matplotlib.image
import numpy as np
import pytest

from onnxfuse.cli.main import main
from onnxfuse.core.errors import InputFileError
from onnxfuse.core._plot import data_overlap
from onnxfuse.training.report import make_report, read_metrics, report_figure, summarize

HEADER = ["step", "model", "split", "loss", "accuracy", "lr", "elapsed_s", "status"]


def _synthetic_rows() -> list[list]:
    """B=3, 9 steps, eval every 3: model 1 diverges at step 4 (frozen after), model 2 is dropped at step 6."""
    rows = []
    for step in range(1, 10):
        for b in range(3):
            if b == 2 and step > 6:
                continue  # dropped: no more rows
            loss = 2.0 / (step + b)
            status = ""
            if b == 1 and step >= 4:
                loss, status = (math.nan, "diverged") if step == 4 else (2.0 / 4, "diverged")
            if b == 2 and step == 6:
                status = "dropped"
            lr = [0.1, 0.5, 0.01][b] * (1 - step / 20)  # a decaying schedule
            rows.append([step, b, "train", loss, "", f"{lr:.6g}", step * 0.01, status])
            if step % 3 == 0:
                rows.append([step, b, "eval", loss * 1.1, 0.5 + 0.04 * step - 0.1 * b, "", step * 0.01, status])
    return rows


def _write(path, header, rows):
    with open(path, "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(header)
        w.writerows(rows)


def _check_png(path):
    img = matplotlib.image.imread(str(path))
    assert img.ndim == 3 and img.shape[0] > 100 and img.shape[1] > 100
    assert img.std() > 0  # something is drawn


def test_report_on_synthetic_metrics(tmp_path):
    _write(tmp_path / "metrics.csv", HEADER, _synthetic_rows())
    s = make_report(tmp_path)
    assert s["B"] == 3 and s["last_step"] == 9
    m0, m1, m2 = s["models"]
    assert m0["status"] == "ok" and m0["status_step"] is None and m0["last_train_loss"] == pytest.approx(2 / 9)
    assert m0["best_eval_loss"] == pytest.approx(1.1 * 2 / 9) and m0["best_eval_loss_step"] == 9
    assert m0["best_eval_accuracy"] == pytest.approx(0.86) and m0["last_eval_accuracy"] == pytest.approx(0.86)
    assert m0["lr"] == pytest.approx(0.1 * 0.95) and m0["final_lr"] == pytest.approx(0.1 * 0.55)
    assert (m1["status"], m1["status_step"]) == ("diverged", 4)
    assert (m2["status"], m2["status_step"]) == ("dropped", 6) and m2["last_train_step"] == 6
    assert s["best_model"] == 0
    panels = {p["name"]: p for p in s["panels"]}
    assert list(panels) == ["train_loss", "eval_loss", "eval_accuracy"]
    assert [c["points"] for c in panels["train_loss"]["curves"]] == [9, 8, 6]  # model 1's nan is not drawn
    assert [c["points"] for c in panels["eval_loss"]["curves"]] == [3, 3, 2]
    # no settings recorded: the models are told apart by the peak lr of metrics.csv
    assert [c["label"] for c in panels["train_loss"]["curves"]] == ["0: lr 0.095", "1: lr 0.475", "2: lr 0.0095"]
    assert panels["train_loss"]["yscale"] == "log" and panels["eval_accuracy"]["yscale"] == "linear"
    marks = {(mk["model"], mk["status"], mk["step"]) for mk in panels["train_loss"]["markers"]}
    assert marks == {(1, "diverged", 4), (2, "dropped", 6)}
    _check_png(tmp_path / "report.png")
    on_disk = json.loads((tmp_path / "report.json").read_text())
    assert on_disk == json.loads(json.dumps(s))  # the file holds the returned summary


def test_report_reads_the_old_header_and_writes_png_elsewhere(tmp_path):
    rows = [[step, b, 1.0 / step + b, 0.1 * (b + 1), step * 0.1] for step in range(1, 6) for b in range(2)]
    _write(tmp_path / "metrics.csv", ["step", "model", "loss", "lr", "elapsed_s"], rows)
    s = make_report(tmp_path, out_png=tmp_path / "plots" / "r.png")
    assert [p["name"] for p in s["panels"]] == ["train_loss"]  # no eval rows: no empty eval panels
    assert len(s["panels"][0]["curves"]) == 2
    assert s["models"][1]["best_eval_loss"] is None and s["models"][1]["status"] == "ok"
    _check_png(tmp_path / "plots" / "r.png")
    assert (tmp_path / "report.json").exists() and not (tmp_path / "report.png").exists()


def test_report_on_a_real_training_run(tmp_path, capsys):
    """A real metrics.csv from train_array on a B=3 MLP array (digits), then the CLI's table."""
    from onnxfuse.exporters import export_array, zoo
    from onnxfuse.core.passes import fuse_models, save_array
    from onnxfuse.training.run import TrainConfig, train_array
    from onnxfuse.recipe.datasets import load_named, reshape_for_input, split_holdout

    paths = export_array(zoo.MLP, tmp_path / "jobs", 3, [16, 64])
    fa = fuse_models(paths)
    save_array(fa, tmp_path / "array")
    data = load_named("sklearn:digits")
    data["input"] = reshape_for_input(data["input"], fa.spec.inputs[0]["shape"])
    train, _ = split_holdout(data, 0.1, seed=0)
    cfg = TrainConfig(steps=8, batch_size=16, optimizer="sgd", lr=[0.3, 0.1, 0.01], log_every=2)
    train_array(tmp_path / "array", train, cfg, progress=False)
    s = make_report(tmp_path / "array")
    assert s["B"] == 3 and s["last_step"] == 8
    assert [m["lr"] for m in s["models"]] == pytest.approx([0.3, 0.1, 0.01])
    assert all(np.isfinite(m["last_train_loss"]) and m["status"] == "ok" for m in s["models"])
    assert [c["points"] for c in s["panels"][0]["curves"]] == [4, 4, 4]  # steps 2, 4, 6, 8
    # the legend names the models by the setting that differs, as the run recorded it
    assert [c["label"] for c in s["panels"][0]["curves"]] == ["0: lr 0.3", "1: lr 0.1", "2: lr 0.01"]
    _check_png(tmp_path / "array" / "report.png")
    code = main(["report", str(tmp_path / "array"), "-o", str(tmp_path / "cli.png")])
    out = capsys.readouterr().out
    header = out.splitlines()[0].split()
    assert code == 0 and header[:4] == ["model", "lr", "train", "loss"] and "eval" not in header  # lr: it differs
    best = min(s["models"], key=lambda m: m["last_train_loss"])["model"]  # no evaluation: by the final train loss
    assert s["best_model"] == best and s["ranked_by"] == {"metric": "train_loss", "state": "final"}
    assert f"best: model {best} by its final train_loss" in out
    assert len(out.splitlines()) == 1 + 3 + 2  # header, 3 models, best, plot path
    assert str(tmp_path / "cli.png") in out
    _check_png(tmp_path / "cli.png")


@pytest.mark.parametrize("case", ["no_folder", "no_metrics", "bad_header", "empty"])
def test_report_bad_input(tmp_path, capsys, case):
    array = tmp_path / "array"
    if case != "no_folder":
        array.mkdir()
    if case == "bad_header":
        _write(array / "metrics.csv", ["step", "model", "value"], [[1, 0, 0.5]])
    elif case == "empty":
        _write(array / "metrics.csv", HEADER, [])
    expect = {"no_folder": "array folder", "no_metrics": "metrics.csv' is missing",
              "bad_header": "has no column 'loss'", "empty": "has no rows"}[case]
    with pytest.raises(InputFileError):
        make_report(array)
    code = main(["report", str(array)])
    err = capsys.readouterr().err
    assert code == 2 and expect in err and err.count("\n") == 1, err
    assert not (array / "report.png").exists()


def test_report_figure_legend_beside_the_data_smoothed_curves_accuracy_in_percent(tmp_path):
    """24 models with long labels: the legend lies below the panels, over none; 40 logged steps are drawn smoothed
    over the raw values; accuracy is plotted in percent, as the table prints it."""
    rng = np.random.default_rng(0)
    rows = []
    for step in range(1, 41):
        for b in range(24):
            loss = 2.0 / step ** (0.2 + 0.02 * b) * math.exp(rng.normal(0, 0.3))
            rows.append([step, b, "train", loss, "", 10.0 ** (-b / 6), 0.1 * step, ""])
            if step % 10 == 0:
                rows.append([step, b, "eval", loss, 0.5 + 0.01 * step, "", 0.1 * step, ""])
    _write(tmp_path / "metrics.csv", HEADER, rows)
    logs = read_metrics(str(tmp_path / "metrics.csv"))
    summary = summarize(logs)
    for m in summary["models"]:  # the per-model settings that differ, as the run recorded them
        m["hparams"] = {"lr": 10.0 ** (-m["model"] / 6), "betas": [0.9, 0.99 + m["model"] / 1000]}
    fig, records = report_figure(logs, summary)
    assert records[0]["curves"][5]["label"] == "5: lr 0.1468, betas (0.9, 0.995)"
    assert [c["smoothed"] for c in records[0]["curves"]] == [True] * 24
    assert not any(c["smoothed"] for c in records[1]["curves"])  # 4 evaluations: drawn as they are
    legend = fig.legends[0]
    assert len(fig.axes) == 3 and data_overlap(fig, legend) == 0  # over no panel
    accuracy = [y for line in fig.axes[2].get_lines() for y in line.get_ydata()]
    assert min(accuracy) == pytest.approx(60) and max(accuracy) == pytest.approx(90)
    raw, trend = fig.axes[0].get_lines()[:2]  # model 0: its raw values faint, then its smoothed curve
    wiggle = [np.std(np.diff(np.log(line.get_ydata()))) for line in (trend, raw)]
    assert raw.get_alpha() < 0.5 and wiggle[0] < wiggle[1]
    fig.savefig(tmp_path / "report.png")
    _check_png(tmp_path / "report.png")


def test_report_marks_each_kept_best_state_and_the_best_model_and_spreads_high_accuracies(tmp_path):
    """The demo's shape: 8 models, 6 learn to 96.7-99.2 % and 2 stay at chance (11 %); best states kept by eval
    accuracy. Each model's kept best state is marked on both eval panels at its step and value (report.json's
    panel records), the best model's as a star, and the legend says which model is best; the accuracy axis is a
    logit one on which 97 -> 99 % is a tenth of the panel's height or more (a linear axis from 11 to 99 % gives it
    2 %), with round percentages as ticks."""
    final = [0.969, 0.981, 0.989, 0.986, 0.992, 0.967, 0.111, 0.111]
    rows = []
    for step in range(20, 301, 20):
        for b, acc in enumerate(final):
            learnt = acc > 0.5
            loss = 2.3 * math.exp(-step / (40 + 20 * b)) + 0.03 if learnt else 2.3
            rows.append([step, b, "train", loss, "", [0.001, 0.003, 0.01, 0.03, 0.1, 0.2, 0.5, 1][b], step * 0.01, ""])
            a = acc - (acc - 0.1) * math.exp(-step / 40) if learnt else 0.09 + 0.001 * (step % 40)
            rows.append([step, b, "eval", loss * 1.1, a - 0.002 * (step == 300), "", step * 0.01, ""])
    _write(tmp_path / "metrics.csv", HEADER, rows)
    logs = read_metrics(str(tmp_path / "metrics.csv"))
    kept = {"metric": "eval_accuracy", "models": {}}
    for b, log in logs.items():
        step, value = max(log.eval_accuracy, key=lambda p: (p[1], -p[0]))
        kept["models"][str(b)] = {"step": step, "value": value}
    summary = summarize(logs, kept)
    assert summary["best_model"] == 4
    fig, records = report_figure(logs, summary)
    panels = {r["name"]: r for r in records}
    for name in ("eval_loss", "eval_accuracy"):
        marks = {m["model"]: (m["step"], m["at"]) for m in panels[name]["kept_best"]}
        assert {b: s for b, (s, _) in marks.items()} == {b: e["step"] for b, e in ((int(k), v) for k, v in
                                                                                     kept["models"].items())}
    at = {m["model"]: m["at"] for m in panels["eval_accuracy"]["kept_best"]}
    assert all(at[int(b)] == pytest.approx(e["value"]) for b, e in kept["models"].items())
    accuracy = fig.axes[2]
    stars = [line for line in accuracy.get_lines() if line.get_marker() == "*"]
    assert len(stars) == 1 and stars[0].get_xdata()[0] == kept["models"]["4"]["step"]
    legend = [t.get_text() for t in fig.legends[0].get_texts()]
    assert legend[4].startswith("4: ") and "best" in legend[4] and not any("best" in t for t in legend[:4])
    assert panels["eval_accuracy"]["yscale"] == "logit"
    fig.canvas.draw()
    y = accuracy.transAxes.inverted().transform(accuracy.transData.transform([(100, 97), (100, 99)]))[:, 1]
    assert y[1] - y[0] > 0.1, y
    ticks = [float(t) for t in accuracy.get_yticks()]
    assert {10, 50, 90, 99} <= set(ticks) and min(ticks) <= 11.1 and max(ticks) >= 99.2
    assert data_overlap(fig, fig.legends[0]) == 0
