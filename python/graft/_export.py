"""Exporting a module for graft: torch.onnx.export with training semantics kept.

* The TorchScript exporter (``dynamo=False`` where the newer exporter is the default): the newer
  one folds a training-mode BatchNorm into the preceding Linear with eval statistics.
* ``export_params=False``: parameters and buffers become graph inputs named as in the module's
  state_dict; graft binds PyTorch's memory to them, so the export writes no copy of the weights.
* ``TrainingMode.PRESERVE``: every submodule is exported in the mode it is in; the module's
  training flags, buffers and parameters are restored afterwards, whatever the exporter did.
* Autocast is off during the export (graft computes in float32; see GraftModule).
* A training-mode multi-layer nn.LSTM / nn.GRU with dropout, which the exporter refuses, is
  exported one layer at a time with Dropout between the layers (_layered_rnn_forward).
* After the export, every trainable parameter of a submodule that ran must be a graph input of
  its own shape: a graph that silently dropped or folded a parameter is refused.
* It is GraftModule's fallback, run in this process: the capture on PyTorch's own tracer
  (_aten.py, Note [capture]) is tried first and builds graft's graph without a file.
"""
import inspect
import os
import re
import traceback
import warnings
from dataclasses import dataclass, field
from typing import Any, List, Tuple

import torch

from . import _flatten
from .errors import GraftExportError, GraftUnsupportedError

PREFIX = "m."  # the wrapped module's attribute name inside the exported wrapper


@dataclass
class Graph:
    """An ONNX file's graph as graft._graft.read_onnx_graph gives it: inputs and outputs as
    (name, elem_type, dims), nodes as (op_type, name, inputs, outputs, {int attribute: value})."""
    inputs: list
    outputs: list
    nodes: list


# ONNX TensorProto element types graft reads here.
FLOAT, DOUBLE = 1, 11


@dataclass
class Exported:
    path: str
    input_names: List[str]                 # graph inputs fed from the call's tensors, in order
    input_index: List[int]                 # for each, its position among the call's tensors
    params: List[Tuple[str, str]] = field(default_factory=list)  # (graph input, state_dict name) of params/buffers
    output_names: List[str] = field(default_factory=list)
    output_template: Any = None
    has_dropout: bool = False
    model: Any = None  # the exported graph (a Graph), read once (GraftModule edits it before graft loads it)
    # Warnings for the caller to issue: (GraftWarning message, None, None, None) or
    # (message, category, filename, lineno).
    warnings: List[Tuple[Any, Any, Any, Any]] = field(default_factory=list)


def _export_kwargs():
    kw = {}
    params = inspect.signature(torch.onnx.export).parameters
    if "dynamo" in params:
        kw["dynamo"] = False  # the TorchScript exporter: keeps training semantics (see above)
    return kw


def _layered_rnn_forward(mod):
    """A forward for a multi-layer nn.LSTM / nn.GRU with dropout that runs its layers one at a time
    with F.dropout between them: what PyTorch's fused kernel computes (dropout on every layer's
    output but the last), in a form torch.onnx.export can export (it refuses dropout inside the
    fused RNN in training mode). Parameters are the module's own (no copy)."""
    lstm = mod.mode == "LSTM"
    dirs = 2 if mod.bidirectional else 1
    per_layer = len(mod._flat_weights) // mod.num_layers
    original = mod.forward

    def forward(input, hx=None):
        if not isinstance(input, torch.Tensor) or input.dim() != 3:
            return original(input, hx)  # packed or unbatched input: the module's own path
        batch = input.size(0 if mod.batch_first else 1)
        if hx is None:
            z = torch.zeros(mod.num_layers * dirs, batch, mod.hidden_size, dtype=input.dtype, device=input.device)
            hx = (z, z) if lstm else z
        out, hs, cs = input, [], []
        for layer in range(mod.num_layers):
            if layer > 0:
                out = torch.nn.functional.dropout(out, mod.dropout, training=True)
            w = mod._flat_weights[layer * per_layer:(layer + 1) * per_layer]
            sl = slice(layer * dirs, (layer + 1) * dirs)
            if lstm:
                out, h, c = torch._VF.lstm(out, (hx[0][sl], hx[1][sl]), w, mod.bias, 1, 0.0, True,
                                           mod.bidirectional, mod.batch_first)
                cs.append(c)
            else:
                out, h = torch._VF.gru(out, hx[sl], w, mod.bias, 1, 0.0, True, mod.bidirectional,
                                       mod.batch_first)
            hs.append(h)
        h = torch.cat(hs, 0)
        return (out, (h, torch.cat(cs, 0))) if lstm else (out, h)

    return forward


def _patch_rnn_dropout(module):
    """Patches every training-mode multi-layer nn.LSTM / nn.GRU with dropout for the export;
    returns the modules patched (undo: del m.forward)."""
    patched = []
    for m in module.modules():
        if (isinstance(m, (torch.nn.LSTM, torch.nn.GRU)) and m.training and m.dropout > 0 and m.num_layers > 1
                and getattr(m, "proj_size", 0) == 0 and "forward" not in m.__dict__):
            m.forward = _layered_rnn_forward(m)
            patched.append(m)
    return patched


def export(module: torch.nn.Module, args, kwargs, tensors, path: str, opset: int, name: str) -> Exported:
    out_holder = {}

    class Flat(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.m = module

        def forward(self, *ts):
            a, kw = _flatten.rebuild((args, kwargs), iter(ts))
            out = self.m(*a, **kw)
            out_holder["template"] = out
            leaves = _flatten.flatten_outputs(out)
            return tuple(leaves)

    input_names = [f"input_{i}" for i in range(len(tensors))]
    modes = [(m, m.training) for m in module.modules()]
    params = list(module.named_parameters())
    buffers = list(module.named_buffers())
    saved_buffers = {n: (b, b.detach().clone(), b._version) for n, b in buffers}
    # Parameters are not copied (that would double the first call's memory): a forward that changes
    # a parameter in place is detected by its version counter and refused.
    param_versions = {n: (p, p._version) for n, p in params}
    called = set()
    hooks = [m.register_forward_pre_hook(lambda m, _a: called.add(id(m))) for m in module.modules()]
    patched_rnns = _patch_rnn_dropout(module)

    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always", torch.jit.TracerWarning)
            with torch.enable_grad(), torch.autocast("cpu", enabled=False):
                torch.onnx.export(Flat(), tuple(tensors), path, input_names=input_names, opset_version=opset,
                                  do_constant_folding=False, export_params=False,
                                  training=torch.onnx.TrainingMode.PRESERVE, **_export_kwargs())
    except GraftExportError:
        raise
    except Exception as ex:  # the exporter's own error: an op it cannot export, a Python value...
        # Only the message string: str() of some exporter errors prints a JIT graph that may be gone
        # by now (torch 1.13 crashes in Graph::toString).
        text = ex.args[0] if ex.args and isinstance(ex.args[0], str) else ""
        first = text.splitlines()[0] if text else ""
        op = re.search(r"operator '([^']+)'", first)
        what = (f"it cannot export the operator {op.group(1)} at opset {opset}" if op
                else f"{type(ex).__name__}: {first}")
        # Drop the exporter's frames now: their locals hold JIT graphs whose late destruction (when
        # the caller lets go of this exception) breaks the next export in torch 1.13.
        traceback.clear_frames(ex.__traceback__)
        raise GraftExportError(
            f"{name}: torch.onnx.export failed ({what}). Keep this module (or the submodule that uses it) in "
            "eager mode, or rewrite it with exportable ops.", "export") from ex
    finally:
        for m in patched_rnns:
            del m.forward
        for h in hooks:
            h.remove()
        for m, t in modes:
            m.training = t
        # The exporter runs forward (a counter, BatchNorm statistics): put the state back.
        mutated = []
        with torch.no_grad():
            for n, (b, before, version) in saved_buffers.items():
                if b._version != version or not torch.equal(b, before):
                    mutated.append(n)
                    b.copy_(before)
            for n, (p, version) in param_versions.items():
                if p._version != version:
                    mutated.append(n)
    # A training-mode BatchNorm updates its running statistics: graft replays that from the
    # BatchNormalization node's running-statistics outputs (GraftModule), so it is not refused.
    replayed = set()
    for mod_name, mod in module.named_modules():
        if isinstance(mod, torch.nn.modules.batchnorm._BatchNorm) and mod.training and mod.track_running_stats:
            if mod.momentum is None:
                raise GraftUnsupportedError(
                    f"{name}: BatchNorm '{mod_name}' has momentum=None (a cumulative average); graft replays "
                    "the exponential update only. Set a momentum, or keep this module in eager mode.",
                    "unsupported")
            prefix = f"{mod_name}." if mod_name else ""
            replayed |= {prefix + "running_mean", prefix + "running_var", prefix + "num_batches_tracked"}
    mutated = [n for n in mutated if n not in replayed]
    if mutated:
        raise GraftUnsupportedError(
            f"{name}: forward updates {', '.join(repr(n) for n in mutated)} in place (a counter, BatchNorm "
            "running statistics...); graft does not replay in-place updates of module state yet, so the module "
            "would not match eager. Keep this module in eager mode.", "unsupported")
    branches = set()
    pending = []
    torch_dir = os.path.dirname(torch.__file__)
    for w in caught:  # pass the exporter's warnings on; a branch on a tensor value gets ours
        if issubclass(w.category, torch.jit.TracerWarning) and "Python boolean" in str(w.message):
            # Once per place; PyTorch's own modules (nn.MultiheadAttention's fast-path checks) branch
            # on shapes and flags, which the cache key already covers: not the user's concern.
            if (w.filename, w.lineno) in branches or os.path.abspath(w.filename).startswith(torch_dir):
                continue
            branches.add((w.filename, w.lineno))
            pending.append((
                f"{name}: the export traced through a Python branch on a tensor value "
                f"({w.filename}:{w.lineno}); graft replays the branch this input took on every call "
                "with these input shapes. If the condition depends on tensor values (not shapes), "
                "keep this module in eager mode.", None, None, None))
        elif issubclass(w.category, torch.jit.TracerWarning) or "Removing mutation" in str(w.message):
            continue
        elif issubclass(w.category, DeprecationWarning) and ("legacy TorchScript-based ONNX export" in str(w.message)
                                                             or "/torch/onnx/" in w.filename.replace("\\", "/")):
            continue  # torch >= 2.9 deprecates the exporter graft chooses (dynamo=False, see above): not the user's
        else:
            pending.append((str(w.message), w.category, w.filename, w.lineno))

    from . import _graft  # reads the file with graft's protobuf classes: no onnx package here
    m = Graph(*_graft.read_onnx_graph(path))
    graph_inputs = {gname: dims for gname, _, dims in m.inputs}
    e = Exported(path=path, input_names=[], input_index=[])
    for i, n in enumerate(input_names):
        if n in graph_inputs:  # the exporter drops unused inputs
            e.input_names.append(n)
            e.input_index.append(i)
    state_names = {PREFIX + n for n, _ in params} | {PREFIX + n for n, _ in buffers}
    for gname, _, _ in m.inputs:
        if gname in state_names:
            e.params.append((gname, gname[len(PREFIX):]))
    e.output_names = [oname for oname, _, _ in m.outputs]
    # The structure of the outputs, with empty tensors where the tensors were: the traced outputs
    # themselves would hold the trace's autograd graph, and with it every activation it saved, as
    # long as the export is cached.
    template = out_holder.pop("template", None)
    e.output_template = _flatten.rebuild(
        template, iter([torch.empty(0) for _ in _flatten.flatten_outputs(template)]))
    del template
    e.has_dropout = any(n[0] == "Dropout" for n in m.nodes)
    e.model = m
    e.warnings = pending

    # Every trainable parameter of a submodule that ran must be in the graph with its own shape.
    in_graph = {pname: graph_inputs[gname] for gname, pname in e.params}
    for mod_name, mod in module.named_modules():
        if id(mod) not in called:
            continue
        for pn, p in mod.named_parameters(recurse=False):
            if p is None or not p.requires_grad:
                continue
            full = f"{mod_name}.{pn}" if mod_name else pn
            gi = in_graph.get(full)
            if gi is None:
                if any(full == n for n, _ in params):  # a parameter of a module that ran, not in the graph
                    raise GraftExportError(
                        f"{name}: the exported graph does not use parameter '{full}' of submodule "
                        f"'{mod_name or type(module).__name__}', which ran in forward (the exporter folded or "
                        "dropped it); graft refuses to train a graph that lost a parameter. Keep this module in "
                        "eager mode.", "export")
                continue
            dims = list(gi)
            if dims != list(p.shape):
                raise GraftExportError(
                    f"{name}: parameter '{full}' has shape {list(p.shape)} but the exported graph has {dims}",
                    "export")
    return e
