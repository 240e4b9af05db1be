"""graft: a C++ training runtime for ONNX graphs that never needs more memory than PyTorch eager.

graft.GraftModule wraps a torch.nn.Module (see graft.frontend); graft.bench reproduces the
seed's memory table against PyTorch.
"""
__all__ = ["GraftModule", "GraftError", "GraftExportError", "GraftUnsupportedError"]


def __getattr__(name):
    # Imported lazily so `python3 -m graft.bench` works without the compiled module.
    if name in __all__:
        from . import frontend
        return getattr(frontend, name)
    if name in ("_graft", "frontend", "bench"):
        import importlib
        return importlib.import_module(f"{__name__}.{name}")
    raise AttributeError(name)
