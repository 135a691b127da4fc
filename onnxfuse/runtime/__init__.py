"""What trains a fused graph, behind ``protocol.Runtime``: ``torch_*`` (the fused graph as a torch program, its
kernels, the trainer) and ``ort_*`` (ONNX Runtime training artifacts and the trainer); ``trainers.py`` says which
class trains for each runtime and makes one."""
