"""The package's version (one place: ``accumkernels.__version__``, ``build_info()``)."""

__version__ = "0.1.0"
