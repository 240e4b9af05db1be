"""graft's exceptions and warnings (pure Python: importable without the compiled module).

Every error graft raises is a GraftError with three fields: ``kind`` (what went wrong, one of the
C++ runtime's error kinds or a front-end kind such as "export"), ``node`` (the model node at fault,
"" when none) and ``message``. The C++ runtime's errors arrive here through ``from_runtime``, so an
error raised anywhere (building a session, forward, backward) is caught by ``except GraftError``.
"""


class GraftError(RuntimeError):
    """A graft error. Fields: kind, node, message."""

    def __init__(self, message: str = "", kind: str = "", node: str = ""):
        super().__init__(message)
        self.message = message
        self.kind = kind
        self.node = node

    def __reduce__(self):  # picklable across processes (DDP workers, multiprocessing)
        return (type(self), (self.message, self.kind, self.node))


class GraftExportError(GraftError):
    """torch.onnx.export could not export the module, or the export would not train as eager does."""


class GraftUnsupportedError(GraftError):
    """The model uses an op, dtype, attribute or PyTorch pattern graft does not support."""


class GraftInvalidModelError(GraftError):
    """The model or graph is malformed."""


class GraftShapeError(GraftError):
    """Shapes that do not fit together."""


class GraftArgumentError(GraftError, ValueError):
    """A bad option, name or input from the caller."""


class GraftOutOfMemoryError(GraftError, MemoryError):
    """A memory budget or the system refused an allocation."""


class GraftIoError(GraftError, OSError):
    """Reading or writing a file failed."""


class GraftNonFiniteError(GraftError, FloatingPointError):
    """A NaN or Inf was produced while checking was on (check_finite=True)."""


class GraftInternalError(GraftError):
    """A graft bug: please report it with the model."""


class GraftWarning(UserWarning):
    """The export may not mean what the module does, or graft runs it differently from eager."""


_BY_KIND = {
    "invalid model": GraftInvalidModelError,
    "unsupported": GraftUnsupportedError,
    "shape mismatch": GraftShapeError,
    "invalid argument": GraftArgumentError,
    "out of memory": GraftOutOfMemoryError,
    "i/o error": GraftIoError,
    "non-finite value": GraftNonFiniteError,
    "internal error": GraftInternalError,
}


def from_runtime(message: str, kind: str, node: str) -> GraftError:
    """The exception for a C++ graft::Error (called by graft._graft's exception translator)."""
    return _BY_KIND.get(kind, GraftError)(message, kind, node)


def with_context(ex: GraftError, prefix: str) -> GraftError:
    """The same error (same class and fields) with ``prefix: `` before its message."""
    return type(ex)(f"{prefix}: {ex.message}", ex.kind, ex.node)
