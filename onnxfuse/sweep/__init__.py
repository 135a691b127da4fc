"""Sweeps: many trials grouped into fused arrays by graph identity and trained on Ray (`onnxfuse sweep`).

``spec.py`` reads the sweep spec, ``planning.py`` turns its trials into arrays, ``driver.py`` runs them on Ray,
``worker.py`` is one array where it runs, ``report.py`` writes the results, ``layout.py`` names the folder's files.
"""
from onnxfuse.sweep.driver import SweepResult, run_sweep
from onnxfuse.sweep.spec import SweepSpec, load_spec, parse_spec

__all__ = ["run_sweep", "SweepResult", "SweepSpec", "load_spec", "parse_spec"]
