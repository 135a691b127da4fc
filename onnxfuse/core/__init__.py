"""The core (the first layer): fusion on ONNX alone -- graph identity, the fusion engine and its op-rule catalog
(``rules/``), the node-rewrite engine (``rewrite.py``) and the standard ONNX forms of onnxfuse's own ops
(``standard.py``), tensor layouts and weight maps, split, the array folder (``array.py``), graph plumbing and static facts, errors, locks and atomic files. It imports neither
torch nor onnxruntime, and no other layer."""
