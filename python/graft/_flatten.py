"""Arguments and outputs of a GraftModule call: where the tensors are, and a key for the rest.

Tensors anywhere in the arguments (tuples, lists, dicts, namedtuples, dataclasses, plain objects)
become graph inputs, never constants; everything else is part of the cache key, by value, so two
calls whose non-tensor arguments differ never share an export. Outputs are rebuilt per call from
the structure the export returned, with the call's tensors in place.
"""
import copy
import dataclasses
import enum
import hashlib

import numpy as np
import torch

_PRIMS = (type(None), bool, int, float, complex, str, bytes)


class Unkeyable(TypeError):
    pass


def flatten_args(obj):
    """(tensors, key): the tensors in `obj` in a fixed order, and a hashable key of everything
    else (structure, types and values)."""
    tensors = []

    def walk(o, depth):
        if isinstance(o, torch.Tensor):
            tensors.append(o)
            return "T"
        if isinstance(o, _PRIMS):
            return (type(o), o)  # 1, 1.0 and True are different keys
        if isinstance(o, (torch.dtype, torch.device, enum.Enum, torch.Size)):
            return (type(o), o)
        if isinstance(o, np.ndarray):  # by value: a numpy array is baked into the graph
            return ("ndarray", o.dtype.str, o.shape, hashlib.sha1(np.ascontiguousarray(o).tobytes()).hexdigest())
        if isinstance(o, np.generic):
            return ("npscalar", o.dtype.str, o.item())
        if depth > 64:
            raise Unkeyable("arguments nested deeper than 64 levels")
        if isinstance(o, tuple) and hasattr(o, "_fields"):
            return ("namedtuple", type(o), tuple(walk(x, depth + 1) for x in o))
        if isinstance(o, (tuple, list)):
            return (type(o), tuple(walk(x, depth + 1) for x in o))
        if isinstance(o, dict):
            return (type(o), tuple((walk(k, depth + 1), walk(v, depth + 1)) for k, v in o.items()))
        if dataclasses.is_dataclass(o) and not isinstance(o, type):
            return ("dataclass", type(o), tuple((f.name, walk(getattr(o, f.name), depth + 1))
                                                for f in dataclasses.fields(o)))
        if isinstance(o, torch.nn.Module):
            return ("module", id(o))
        if hasattr(o, "__dict__") and not callable(o) and not isinstance(o, type):
            return ("object", type(o), tuple((k, walk(v, depth + 1)) for k, v in sorted(vars(o).items())))
        try:
            hash(o)
        except TypeError:
            raise Unkeyable(f"an argument of type {type(o).__name__} is neither a tensor nor a value graft can "
                            "compare between calls") from None
        return ("hashable", o)

    key = walk(obj, 0)
    return tensors, key


def rebuild(template, it):
    """`template` with each tensor replaced by the next one of iterator `it` (same walk order as
    flatten_args / flatten_outputs)."""
    o = template
    if isinstance(o, torch.Tensor):
        return next(it)
    if isinstance(o, _PRIMS) or isinstance(o, (np.ndarray, np.generic, torch.dtype, torch.device, enum.Enum)):
        return o
    if isinstance(o, tuple) and hasattr(o, "_fields"):
        return type(o)(*[rebuild(x, it) for x in o])
    if isinstance(o, tuple):
        return type(o)(rebuild(x, it) for x in o) if type(o) is not tuple else tuple(rebuild(x, it) for x in o)
    if isinstance(o, list):
        return type(o)(rebuild(x, it) for x in o)
    if isinstance(o, dict):
        vals = [(k, rebuild(v, it)) for k, v in o.items()]
        new = copy.copy(o)
        for k, v in vals:
            new[k] = v
        return new
    if dataclasses.is_dataclass(o) and not isinstance(o, type):
        new = copy.copy(o)
        for f in dataclasses.fields(o):
            object.__setattr__(new, f.name, rebuild(getattr(o, f.name), it))
        return new
    if isinstance(o, torch.nn.Module):
        return o
    if hasattr(o, "__dict__") and not callable(o) and not isinstance(o, type):
        new = copy.copy(o)
        for k, v in sorted(vars(o).items()):
            new.__dict__[k] = rebuild(v, it)
        return new
    return o


def flatten_outputs(out):
    """The tensors of a module's output, in rebuild order."""
    tensors, _ = flatten_args(out)
    return tensors


_PRIM_TYPES = frozenset(_PRIMS)


def _plain(v) -> bool:
    t = type(v)
    if t in _PRIM_TYPES:
        return True
    if t is tuple:  # set(map(type, v)): no Python-level loop for the usual tuples of ints
        return set(map(type, v)) <= _PRIM_TYPES or all(isinstance(x, _PRIMS) for x in v)
    return isinstance(v, _PRIMS)  # a subclass (an IntEnum, numpy.float64)


def module_state(module):
    """What of a module's Python state an export bakes in: every submodule's `training` flag and
    its other plain attributes (numbers, strings, tuples of them: a Dropout's p, a scale set by the
    user), and the keys of its forward (pre-)hooks, which the capture records (Note [forward hooks],
    _aten.py), and of its backward (pre-)hooks (Note [backward hooks], _pyfunc.py). A change makes a new export. Runs on every call: the submodules in module.modules()'s
    order (pre-order, each once) by an explicit walk, without the qualified names modules() builds."""
    state = []
    seen = set()
    stack = [module]
    while stack:
        m = stack.pop()
        if id(m) in seen:
            continue
        seen.add(id(m))
        state.append((tuple([(k, v) for k, v in m.__dict__.items() if k[:1] != "_" and _plain(v)]),
                      tuple(m._forward_pre_hooks), tuple(m._forward_hooks), tuple(m._backward_hooks),
                      tuple(getattr(m, "_backward_pre_hooks", ()))))
        children = [c for c in m._modules.values() if c is not None]
        children.reverse()
        stack.extend(children)
    return tuple(state)
