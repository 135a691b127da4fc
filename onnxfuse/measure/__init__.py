"""Measurement: ``onnxfuse bench`` (``bench.py`` and its ``bench_*.py``), its workloads and HFTA-style hand-fused peers,
array sizing (``sizing.py``, ``onnxfuse plan``) and the measured choice of fused forms (``forms.py``)."""
