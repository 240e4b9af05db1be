"""graft.GraftModule: train a torch.nn.Module through graft, like ORTModule, with eager .grad.

    model = graft.GraftModule(model, gradients="hook")   # wrap
    loss = loss_fn(model(x), y); loss.backward(); opt.step()   # train as usual
    ddp = DistributedDataParallel(graft.GraftModule(model))    # DDP wraps GraftModule

On the first call (and whenever the input signature changes) the module is exported with
torch.onnx.export in training (or eval) mode and a graft session is built and cached. Parameters
are shared, not copied: graft reads each parameter's storage in place on every call, so
optimizer.step() on the original parameters is seen by graft. Gradient delivery:

* "accumulate": graft adds each gradient into param.grad in place the moment it is complete
  (adopting graft's buffer as param.grad, without a copy, when it is None).
* "hook": at that moment graft hands the gradient to PyTorch's own accumulation
  (param.backward(grad)), so param.register_hook hooks and DistributedDataParallel's allreduce
  hooks fire during graft's backward.
* "hold": parameters are inputs of the autograd Function and every gradient comes back when
  graft's backward ends (the old ORTModule behaviour, kept as the baseline).
"""
import os
import re
import sys
import tempfile
import time
import warnings
from typing import Any, Dict, List, Optional, Tuple

import torch
from torch.utils import _pytree as pytree

from . import _graft

_DTYPES = {torch.float32: "float32", torch.float64: "float64", torch.int64: "int64", torch.bool: "bool"}

# Instrumentation for tests: set to a list and _GraftFunction.backward appends
# ("graft_backward_start" | "graft_backward_end", time.monotonic()) around graft's backward.
TRACE: Optional[list] = None


class GraftError(RuntimeError):
    """A graft error surfaced in Python (the message names the module, node or op at fault)."""


class GraftExportError(GraftError):
    """torch.onnx.export could not export the module (e.g. data-dependent control flow)."""


class GraftUnsupportedError(GraftError):
    """The exported model uses an op, dtype or attribute graft does not support."""


class GraftWarning(UserWarning):
    """The export may not mean what the module does (e.g. a Python branch on a tensor value)."""


def _dtype_name(t: torch.Tensor, what: str, module_name: str) -> str:
    try:
        return _DTYPES[t.dtype]
    except KeyError:
        raise GraftUnsupportedError(
            f"{module_name}: {what} has dtype {t.dtype}; graft supports float32, float64, int64 and bool. "
            "Cast it before calling the module, or keep this module in eager mode.") from None


class _Entry:
    """One exported model + graft session, for one input signature."""

    def __init__(self):
        self.session = None
        self.input_names: List[str] = []
        self.float_outputs: List[str] = []
        self.output_names: List[str] = []
        self.output_spec = None
        self.params: List[Tuple[str, torch.Tensor]] = []      # every initializer we bind (params + buffers)
        self.trainable: List[Tuple[str, torch.nn.Parameter]] = []
        self.input_grads: List[str] = []
        self.training_run = False
        self.run_id = 0  # bumped by every forward; a backward must belong to the latest one


def _wrap_outputs(arrays, owners):
    """torch tensors over graft's output arrays, zero-copy. An output that aliases torch memory
    graft was given (an input passed through, a view of a parameter) is graft-external: the numpy
    array does not keep that memory alive, so it becomes a view of the torch tensor owning it."""
    out = []
    for a in arrays:
        ptr, nbytes = a.__array_interface__["data"][0], a.nbytes
        t = torch.from_numpy(a)
        for o in owners:
            base = o.data_ptr()
            if nbytes and o.dtype == t.dtype and base <= ptr and ptr + nbytes <= base + o.numel() * o.element_size():
                off = (ptr - base) // o.element_size()
                t = o.detach().reshape(-1)[off:off + t.numel()].view(t.shape)
                break
        out.append(t)
    return out


class _Deliver(torch.autograd.Function):
    """A one-node graph whose backward hands `box`'s gradient to the parameter's AccumulateGrad.
    Unlike torch.autograd.backward(param, grad), no Python reference to the gradient is left when
    AccumulateGrad runs, so when .grad is None it adopts the buffer as eager PyTorch does."""

    @staticmethod
    def forward(ctx, param, box):
        ctx.box = box
        return param.new_zeros(())

    @staticmethod
    def backward(ctx, _):
        return ctx.box.pop(), None


class _GraftFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, entry: _Entry, dummy, *tensors):
        sess = entry.session
        if sess.in_run():  # a forward whose backward never came: drop what it saved
            sess.cancel()
        n_in = len(entry.input_names)
        keep = []
        for name, t in zip(entry.input_names, tensors[:n_in]):
            t = t.detach().contiguous()
            keep.append(t)
            sess.set_input(name, t.data_ptr(), list(t.shape), _DTYPES[t.dtype])
        for name, p in entry.params:
            d = p.detach()
            if not d.is_contiguous():
                raise GraftError(f"parameter '{name}' is not contiguous; graft shares parameter memory in place")
            sess.bind_param(name, d.data_ptr(), list(d.shape), _DTYPES[d.dtype])
        arrays = sess.forward()
        outs = _wrap_outputs(arrays, keep + [p for _, p in entry.params])  # zero-copy views
        del arrays
        entry.run_id += 1
        ctx.entry, ctx.keep, ctx.run_id, ctx.training_run = entry, keep, entry.run_id, entry.training_run
        if not entry.training_run:
            sess.cancel()
        ctx.mark_non_differentiable(*[o for o in outs if not o.is_floating_point()])
        return tuple(outs)

    @staticmethod
    def backward(ctx, *grad_outputs):
        entry: _Entry = ctx.entry
        sess = entry.session
        if not ctx.training_run:  # nothing here needs a gradient (outputs require grad via the dummy)
            return (None,) * len(ctx.needs_input_grad)
        if ctx.run_id != entry.run_id or not sess.in_run():
            raise GraftError(
                f"{entry.module_name}: this backward belongs to a forward that a later forward with the same "
                "input shapes replaced (graft keeps one run in flight per input signature). Call backward "
                "before the next forward, or run the other forward under torch.no_grad().")
        grads, keep = {}, []
        for name, out_grad, (oname, dt, shape) in zip(entry.output_names, grad_outputs, entry.outputs_info):
            if name not in entry.float_outputs:
                continue
            g = out_grad if out_grad is not None else torch.zeros(shape, dtype=getattr(torch, dt))
            g = g.detach().contiguous()
            keep.append(g)
            grads[name] = (g.data_ptr(), list(g.shape), _DTYPES[g.dtype])
        mode = entry.mode
        param_grads = []
        if TRACE is not None:
            TRACE.append(("graft_backward_start", time.monotonic()))
        if mode == "accumulate":
            for name, p in entry.trainable:
                pg = p.grad
                if pg is not None and pg.is_contiguous() and pg.dtype == p.dtype and not pg.requires_grad:
                    sess.bind_grad(name, pg.data_ptr(), list(pg.shape), _DTYPES[pg.dtype])
                else:
                    sess.bind_grad(name, None, [], "")
            try:
                sess.backward(grads)
            finally:
                for name, p in entry.trainable:
                    g = sess.take_grad(name)  # a buffer graft adopted as .grad: hand it over
                    if g is not None:
                        g = torch.from_numpy(g)
                        if p.grad is None:
                            p.grad = g
                        else:  # p.grad was not usable in place (dtype / layout): add into it
                            p.grad.add_(g)
                    sess.bind_grad(name, None, [], "")  # graft keeps no pointer to torch memory
        elif mode == "hook":
            by_name = dict(entry.trainable)

            def deliver(name, array, exclusive):
                # PyTorch's own accumulation path: AccumulateGrad, tensor hooks, DDP's hooks.
                if exclusive:  # graft keeps no other reference: AccumulateGrad may adopt it as .grad
                    box = [torch.from_numpy(array)]
                    with torch.enable_grad():
                        torch.autograd.backward(_Deliver.apply(by_name[name], box))
                else:  # the caller holds a reference, so AccumulateGrad copies (or adds in place)
                    torch.autograd.backward(by_name[name], torch.from_numpy(array))

            sess.backward(grads, deliver)
        else:  # hold
            for name, _ in entry.trainable:
                sess.bind_grad(name, None, [], "")
            sess.backward(grads)
            for name, p in entry.trainable:
                g = sess.take_grad(name)
                param_grads.append(torch.from_numpy(g) if g is not None else None)
        if TRACE is not None:
            TRACE.append(("graft_backward_end", time.monotonic()))
        arrays = [sess.input_grad(name) for name in entry.input_grads]
        igrads = dict(zip(entry.input_grads, _wrap_outputs(arrays, keep)))
        del arrays
        sess.cancel()  # graft keeps no reference to outputs or gradients between steps
        input_grads = [igrads.get(name) for name in entry.input_names]
        return (None, None, *input_grads, *param_grads)


def _add_module_prefix(state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys, error_msgs):
    for k in [k for k in state_dict if k.startswith(prefix)]:
        state_dict[prefix + "module." + k[len(prefix):]] = state_dict.pop(k)


class GraftModule(torch.nn.Module):
    """Wraps `module` so that its forward and backward run in graft (see the module docstring)."""

    def __init__(self, module: torch.nn.Module, gradients: str = "hook", opset: int = 17,
                 check_finite: bool = False, max_memory: int = 0):
        super().__init__()
        if gradients not in ("hook", "accumulate", "hold"):
            raise ValueError(f"gradients must be 'hook', 'accumulate' or 'hold', not {gradients!r}")
        self.module = module
        self.gradients = gradients
        self.opset = opset
        self.check_finite = check_finite
        self.max_memory = max_memory
        self._cache: Dict[Any, _Entry] = {}
        self._dummy = torch.zeros(0, requires_grad=True)  # makes outputs require grad (see forward)
        # Inside a parent module, load_state_dict reaches the wrapped module through this one: the
        # keys state_dict gave (the wrapped module's, no "module.") get that step back.
        self._register_load_state_dict_pre_hook(_add_module_prefix)

    # state_dict / load_state_dict are those of the wrapped module.
    def state_dict(self, *args, **kwargs):
        return self.module.state_dict(*args, **kwargs)

    def load_state_dict(self, *args, **kwargs):
        return self.module.load_state_dict(*args, **kwargs)

    # DistributedDataParallel reads this attribute once, when it wraps the module: the one moment
    # to refuse what cannot work. "accumulate" writes .grad past autograd, so DDP's allreduce hooks
    # would never fire. find_unused_parameters=True (without static_graph) searches the autograd
    # graph for parameters, where "hook" mode's are not (graft delivers them itself), and so marks
    # every parameter unused, then ready a second time when graft delivers its gradient.
    @property
    def _ddp_params_and_buffers_to_ignore(self):
        if self.gradients == "accumulate":
            raise GraftError(
                f"{self._name()}: DistributedDataParallel needs gradients='hook' (or 'hold'): with "
                "'accumulate' graft writes .grad directly, so DDP's allreduce hooks would never fire and "
                "gradients would not be averaged across processes.")
        ddp = sys._getframe(1).f_locals  # DistributedDataParallel.__init__, where it asks
        if (self.gradients == "hook" and isinstance(ddp.get("self"), torch.nn.parallel.DistributedDataParallel)
                and ddp.get("find_unused_parameters") and not ddp.get("static_graph")):
            raise GraftError(
                f"{self._name()}: DistributedDataParallel(find_unused_parameters=True) does not work with "
                "gradients='hook' (DDP looks for parameters in the autograd graph; graft delivers their "
                "gradients itself). Pass find_unused_parameters=False or static_graph=True, or use "
                "gradients='hold'.")
        try:
            return self.__dict__["_graft_ddp_ignore"]
        except KeyError:
            raise AttributeError("_ddp_params_and_buffers_to_ignore") from None

    @_ddp_params_and_buffers_to_ignore.setter
    def _ddp_params_and_buffers_to_ignore(self, value):
        self.__dict__["_graft_ddp_ignore"] = value

    def _name(self) -> str:
        return type(self.module).__name__

    def _key(self, flat_args):
        sig = []
        for a in flat_args:
            if isinstance(a, torch.Tensor):
                sig.append((tuple(a.shape), a.dtype, a.requires_grad and a.is_floating_point()))
            else:
                sig.append(("const", repr(a)))
        frozen = tuple(n for n, p in self.module.named_parameters() if not p.requires_grad)
        return (tuple(sig), self.training, frozen)

    def _build(self, args, flat_args, spec) -> _Entry:
        # The exported file is only read while the session is built: nothing of it stays on disk.
        with tempfile.TemporaryDirectory(prefix="graft_") as tmp:
            return self._build_in(os.path.join(tmp, "model.onnx"), flat_args, spec)

    def _build_in(self, path, flat_args, spec) -> _Entry:
        e = _Entry()
        e.mode = self.gradients
        e.module_name = self._name()
        module = self.module
        out_spec = {}

        class Flat(torch.nn.Module):
            def __init__(self):
                super().__init__()
                self.m = module

            def forward(self, *tensors):
                it = iter(tensors)
                full = [next(it) if isinstance(a, torch.Tensor) else a for a in flat_args]
                a, kw = pytree.tree_unflatten(full, spec)
                out = self.m(*a, **kw)
                leaves, out_spec["spec"] = pytree.tree_flatten(out)
                bad = [type(x).__name__ for x in leaves if not isinstance(x, torch.Tensor)]
                if bad:
                    raise GraftExportError(f"{type(module).__name__} returns non-tensor values ({', '.join(bad)})")
                return tuple(leaves)

        tensors = tuple(a for a in flat_args if isinstance(a, torch.Tensor))
        e.input_names = [f"input_{i}" for i in range(len(tensors))]
        buffers = {n: b.detach().clone() for n, b in module.named_buffers()}  # export must not change state
        try:
            with torch.no_grad(), warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always", torch.jit.TracerWarning)
                torch.onnx.export(Flat(), tensors, path, input_names=e.input_names,
                                  opset_version=self.opset, do_constant_folding=False, export_params=True,
                                  training=torch.onnx.TrainingMode.TRAINING if self.training
                                  else torch.onnx.TrainingMode.EVAL)
        except GraftExportError:
            raise
        except Exception as ex:  # the exporter's own error: an op it cannot export, a Python value...
            first = str(ex).splitlines()[0] if str(ex) else ""
            op = re.search(r"operator '([^']+)'", first)
            what = (f"it cannot export the operator {op.group(1)} at opset {self.opset}" if op
                    else f"{type(ex).__name__}: {first}")
            raise GraftExportError(
                f"{self._name()}: torch.onnx.export failed ({what}). Keep this module (or the submodule "
                "that uses it) in eager mode, or rewrite it with exportable ops.") from ex
        finally:
            with torch.no_grad():
                for n, b in module.named_buffers():
                    b.copy_(buffers[n])
        for w in caught:  # pass the exporter's warnings on; a branch on a tensor value gets ours
            if issubclass(w.category, torch.jit.TracerWarning) and "Python boolean" in str(w.message):
                warnings.warn(GraftWarning(
                    f"{self._name()}: the export traced through a Python branch on a tensor value "
                    f"({w.filename}:{w.lineno}); graft replays the branch this input took on every call "
                    "with these input shapes. If the condition depends on tensor values (not shapes), "
                    "keep this module in eager mode."), stacklevel=5)
            else:
                warnings.warn_explicit(w.message, w.category, w.filename, w.lineno)
        e.output_spec = out_spec["spec"]

        import onnx  # Debian's python3-onnx
        m = onnx.load(path, load_external_data=False)
        e.output_names = [o.name for o in m.graph.output]
        init_names = [i.name for i in m.graph.initializer]
        graph_inputs = {i.name for i in m.graph.input}
        e.input_names = [n for n in e.input_names if n in graph_inputs]  # the exporter drops unused inputs
        kept_inputs = [i for i, n in enumerate(f"input_{k}" for k in range(len(tensors))) if n in graph_inputs]
        e.input_index = kept_inputs
        named = {f"m.{n}": p for n, p in module.named_parameters()}
        named_buffers = {f"m.{n}": b for n, b in module.named_buffers()}
        freeze = []
        for n in init_names:
            if n in named and named[n].requires_grad and named[n].is_floating_point():
                e.trainable.append((n, named[n]))
                e.params.append((n, named[n]))
            elif n in named or n in named_buffers:
                e.params.append((n, named.get(n, named_buffers.get(n))))
                freeze.append(n)
            else:  # a constant the exporter made: graft keeps its own copy
                freeze.append(n)
        in_tensors = [tensors[i] for i in kept_inputs]
        e.input_grads = [n for n, t in zip(e.input_names, in_tensors) if t.requires_grad and t.is_floating_point()]
        for n, t in zip(e.input_names, in_tensors):
            _dtype_name(t, f"input '{n}'", self._name())
        try:
            # Differentiate every float output (autograd feeds their gradients).
            float_outputs = [o.name for o in m.graph.output
                             if o.type.tensor_type.elem_type in (onnx.TensorProto.FLOAT, onnx.TensorProto.DOUBLE)]
            e.float_outputs = float_outputs
            e.session = _graft.Session(path, {}, float_outputs, freeze, e.input_grads, self.gradients,
                                       self.check_finite, self.max_memory)
            e.outputs_info = e.session.outputs_info()
        except _graft.GraftError as ex:
            msg, kind = ex.args if len(ex.args) == 2 else (str(ex), "")
            msg = msg.replace(f"{path}: ", "")
            for name in re.findall(r"node '([^']+)' \(Constant\)", msg):  # name what the constant feeds
                outs = {o for n in m.graph.node if n.name == name for o in n.output}
                users = [f"{n.op_type} node '{n.name}'" for n in m.graph.node if outs & set(n.input)]
                if users:
                    msg += f" (the constant feeds {', '.join(users)})"
            if kind == "unsupported":
                raise GraftUnsupportedError(f"{self._name()}: {msg}. Keep the submodule that uses it in eager "
                                            "mode, or rewrite it with ops graft supports.") from None
            raise GraftError(f"{self._name()}: {msg}") from None
        return e

    def forward(self, *args, **kwargs):
        flat_args, spec = pytree.tree_flatten((args, kwargs))
        for i, a in enumerate(flat_args):
            if isinstance(a, torch.Tensor):
                _dtype_name(a, f"input {i}", self._name())
        key = self._key(flat_args)
        entry = self._cache.get(key)
        if entry is None:
            entry = self._build(args, flat_args, spec)
            self._cache[key] = entry
        tensors = [a for a in flat_args if isinstance(a, torch.Tensor)]
        tensors = [tensors[i] for i in entry.input_index]
        any_grad = bool(entry.trainable) or bool(entry.input_grads)
        entry.training_run = torch.is_grad_enabled() and any_grad
        extra = [p for _, p in entry.trainable] if self.gradients == "hold" else []
        try:
            outs = _GraftFunction.apply(entry, self._dummy, *tensors, *extra)
        except _graft.GraftError as ex:
            msg = ex.args[0] if ex.args else str(ex)
            raise GraftError(f"{self._name()}: {msg}") from None
        return pytree.tree_unflatten(list(outs), entry.output_spec)
