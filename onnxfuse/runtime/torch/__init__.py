"""The torch runtime: the fused graph as a torch program (``program``, one builder per ONNX op in ``kernels/``, one
module per op family; ``patterns`` the ONNX chains run as one torch op), the array as an ``nn.Module``
(``array_module``), the per-model optimizers (``optimizers``, ``onnxfuse.optim``), mixed precision
(``precision``), the step (``train_step``) and ``trainer.TorchTrainer``."""
