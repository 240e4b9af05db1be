"""graft: a C++ training runtime for ONNX graphs that never needs more memory than PyTorch eager.

graft.GraftModule wraps a torch.nn.Module (see graft.frontend); graft.bench reproduces the
seed's memory table against PyTorch. Errors: graft.errors (every one is a graft.GraftError).
"""
from .errors import (GraftArgumentError, GraftError, GraftExportError, GraftInternalError,  # noqa: F401
                     GraftInvalidModelError, GraftIoError, GraftNonFiniteError, GraftOutOfMemoryError,
                     GraftShapeError, GraftUnsupportedError, GraftWarning)

__all__ = ["GraftModule", "init_empty_weights", "GraftError", "GraftExportError", "GraftUnsupportedError", "GraftInvalidModelError",
           "GraftShapeError", "GraftArgumentError", "GraftOutOfMemoryError", "GraftIoError", "GraftNonFiniteError",
           "GraftInternalError", "GraftWarning"]


def __getattr__(name):
    # Imported lazily so `python3 -m graft.bench` works without the compiled module.
    if name == "GraftModule":
        from . import frontend
        return frontend.GraftModule
    if name in ("init_empty_weights", "read_safetensors"):
        from . import _weights
        return getattr(_weights, name)
    if name in ("_graft", "frontend", "bench", "optim"):
        import importlib
        return importlib.import_module(f"{__name__}.{name}")
    raise AttributeError(name)
