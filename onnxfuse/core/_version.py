"""onnxfuse's version, written once: the package's ``__version__``, ``onnxfuse --version`` and the installed
metadata (pyproject.toml reads it: ``[tool.setuptools.dynamic]``) all come from here."""
__version__ = "0.1.0"
