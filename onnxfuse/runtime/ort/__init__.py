"""The ONNX Runtime runtime: onnxruntime-training's artifacts for a fused array (``artifacts``), the trainer that
runs them (``trainer.OrtTrainer``) and the legalization that makes a fused graph trainable by it (``legalize/``)."""
