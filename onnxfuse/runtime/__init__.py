"""What trains a fused graph, behind ``onnxfuse.recipe.runtimes.Runtime``: ``torch_*`` (the fused graph as a torch
program, its kernels, the trainer) and ``ort_*`` (ONNX Runtime training artifacts and the trainer)."""
