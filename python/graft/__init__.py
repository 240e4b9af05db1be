"""graft: a C++ training runtime for ONNX graphs that never needs more memory than PyTorch eager.

graft.GraftModule wraps a torch.nn.Module (see graft.frontend); graft.bench reproduces the
seed's memory table against PyTorch. Errors: graft.errors (every one is a graft.GraftError).
"""
from .errors import (GraftArgumentError, GraftError, GraftExportError, GraftInternalError,  # noqa: F401
                     GraftInvalidModelError, GraftIoError, GraftNonFiniteError, GraftOutOfMemoryError,
                     GraftShapeError, GraftUnsupportedError, GraftWarning)

__all__ = ["GraftModule", "init_empty_weights", "empty_cache", "memory_cache_stats", "GraftError", "GraftExportError", "GraftUnsupportedError", "GraftInvalidModelError",
           "GraftShapeError", "GraftArgumentError", "GraftOutOfMemoryError", "GraftIoError", "GraftNonFiniteError",
           "GraftInternalError", "GraftWarning"]


def empty_cache():
    """Gives every block graft keeps for reuse back to the system (like torch.cuda.empty_cache).

    graft keeps its large blocks when they are freed, for the next step to take (no page faults,
    no holes in malloc's heap), never more than the most it ever had in use at once; this returns
    them, and that ceiling restarts from what is in use now. Nothing in use is touched.
    """
    from . import _graft
    _graft.empty_cache()


def memory_cache_stats():
    """Bytes of graft's blocks in use and kept for reuse, the ceiling on their sum, and counts of
    requests served from a kept range of their size (hits) or from part of a larger one (splits), new
    mappings (maps), grown ones (resizes) and ranges given back (unmaps)."""
    from . import _graft
    return dict(_graft.block_cache_stats())


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
