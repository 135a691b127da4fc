"""Bridges to other tools' APIs (each imports its tool only when used): ``onnxfuse.integrations.optuna``."""
