"""What trains a fused graph, behind ``protocol.Runtime``, one package per backend: ``torch/`` (the fused graph as a
torch program, its kernels, the per-model optimizers, the step, ``TorchTrainer``) and ``ort/`` (ONNX Runtime
training artifacts, the legalization that makes a graph trainable by it, ``OrtTrainer``). What both run is here:
``graph_passes`` (the loss, the inference graph, weights as inputs), ``trainers`` (which class trains for each
runtime, and making one), ``_machine`` (the CPU a figure was measured on) and ``process`` (the process-wide settings
a training process wants, which the command line applies and the Python API applies only when asked)."""
