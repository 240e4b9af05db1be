"""graft.GraftModule: train a torch.nn.Module through graft, like ORTModule, with eager .grad.

    model = graft.GraftModule(model, gradients="hook")   # wrap
    loss = loss_fn(model(x), y); loss.backward(); opt.step()   # train as usual
    ddp = DistributedDataParallel(graft.GraftModule(model))    # DDP wraps GraftModule

On the first call, and whenever what the export bakes in changes, the module is exported with
torch.onnx.export (graft._export) and a graft session is built and cached. What the cache key
covers: the structure and values of every non-tensor argument, each tensor argument's shape,
dtype, device and requires_grad, each submodule's training flag and plain attributes (a Dropout's
p, a user's scale), and which parameters are frozen. Tensors anywhere in the arguments are graph
inputs, never constants. The cache is LRU-bounded (cache_size). Parameters are looked up on every
call: a parameter replaced by one of the same shape and dtype is rebound; any other change makes a
new export. Parameters are shared, not copied, so optimizer.step() on them is seen by graft.

Gradient delivery ("accumulate", "hook", "hold") and what autograd asks for: graft._function.
"""
import collections
import contextlib
import dataclasses
import gc
import math
import os
import sys
import tempfile
import threading
import warnings
from typing import Any, Dict, List, Tuple

import torch

from . import _aten, _export, _flatten
from ._function import DTYPES, GraftFunction, _accumulate_grad_node, relay_outputs
from .errors import (GraftArgumentError, GraftError, GraftExportError, GraftInternalError,  # noqa: F401
                     GraftInvalidModelError, GraftShapeError, GraftUnsupportedError, GraftWarning, with_context)

# Instrumentation for tests: set to a list and graft's backward appends
# ("graft_backward_start" | "graft_backward_end", time.monotonic()) around graft's backward.
TRACE = None

MODES = ("hook", "accumulate", "hold", "step")


def _dtype_ok(t: torch.Tensor, what: str, module_name: str):
    if t.dtype not in DTYPES:
        raise GraftUnsupportedError(
            f"{module_name}: {what} has dtype {t.dtype}; graft supports float32, float64, int64, int32 and bool. "
            "Cast it before calling the module, or keep this module in eager mode.", "unsupported")


def _device_ok(t: torch.Tensor, what: str, module_name: str):
    if t.device.type != "cpu":
        raise GraftUnsupportedError(
            f"{module_name}: {what} is on device '{t.device}'; graft runs on the CPU. Move it with .cpu(), or keep "
            "this module in eager mode.", "unsupported")


def _autocast_cpu_dtype():
    try:
        return torch.get_autocast_dtype("cpu")  # torch >= 2.4
    except (AttributeError, TypeError):
        return torch.get_autocast_cpu_dtype()


def _autocast_cpu() -> bool:
    try:
        return torch.is_autocast_enabled("cpu")  # torch >= 2.4; is_autocast_cpu_enabled() is deprecated
    except TypeError:
        return torch.is_autocast_cpu_enabled()


@dataclasses.dataclass(eq=False)
class _Entry:
    """One export + graft session, for one cache key."""
    session: Any = None
    module_name: str = ""
    mode: str = "hook"
    input_names: List[str] = dataclasses.field(default_factory=list)
    input_index: List[int] = dataclasses.field(default_factory=list)  # position among the call's tensors
    param_inputs: List[str] = dataclasses.field(default_factory=list)  # graph inputs bound to module state
    slots: List[Tuple[Any, str, str]] = dataclasses.field(default_factory=list)  # (owner, attribute, param|buffer)
    current: List[torch.Tensor] = dataclasses.field(default_factory=list)  # per param input: bound now
    trainable: List[Tuple[str, torch.nn.Parameter]] = dataclasses.field(default_factory=list)
    input_grads: List[str] = dataclasses.field(default_factory=list)
    output_names: List[str] = dataclasses.field(default_factory=list)
    float_outputs: List[str] = dataclasses.field(default_factory=list)
    outputs_info: list = dataclasses.field(default_factory=list)
    output_template: Any = None
    hook_calls: list = dataclasses.field(default_factory=list)  # Note [forward hooks]
    weight_hooks: list = dataclasses.field(default_factory=list)  # Note [weight hooks] (_aten.py)
    free: List[torch.Tensor] = dataclasses.field(default_factory=list)  # Note [free tensors] (_aten.py)
    free_check: Any = None
    has_dropout: bool = False
    optimizer: Any = None  # gradients="step": the torch.optim optimizer applied inside backward
    step_flags: Any = None  # gradients="step": the GraftModule's {"defer": bool} (defer_step)
    # After each forward, the new value of module state or of a call tensor the forward wrote:
    # (graph output, ("slot", index in current) | ("state", state_dict name) | ("input", call tensor index)).
    state_updates: List[Tuple[str, Tuple[str, Any]]] = dataclasses.field(default_factory=list)
    counters: List[torch.Tensor] = dataclasses.field(default_factory=list)  # num_batches_tracked buffers
    lock: Any = dataclasses.field(default_factory=threading.Lock)
    calls: int = 0
    _acc: Dict[int, Tuple[torch.Tensor, Any]] = dataclasses.field(default_factory=dict)

    def refresh_trainable(self):
        self.trainable = [(g, p) for g, p, (_, _, kind) in zip(self.param_inputs, self.current, self.slots)
                          if kind == "param" and p.requires_grad and p.is_floating_point()]

    def trainable_params(self):
        return [p for _, p in self.trainable]

    def params_current(self, module_name) -> bool:
        """Rebinds parameters replaced by ones of the same shape / dtype; False if the export no
        longer fits (a new shape, dtype or requires_grad, or a parameter removed)."""
        changed = False
        for i, (owner, attr, kind) in enumerate(self.slots):
            cur = (owner._parameters if kind == "param" else owner._buffers).get(attr)
            ref = self.current[i]
            if cur is ref:
                continue
            if cur is None or cur.shape != ref.shape or cur.dtype != ref.dtype or cur.requires_grad != ref.requires_grad:
                return False
            _device_ok(cur, f"parameter '{self.param_inputs[i][len(_export.PREFIX):]}'", module_name)
            self.current[i] = cur
            changed = True
        if changed:
            self.refresh_trainable()
        return True

    def acc_node(self, p):
        hit = self._acc.get(id(p))
        if hit is None or hit[0] is not p:
            hit = (p, _accumulate_grad_node(p))
            self._acc[id(p)] = hit
        return hit[1]

    def draw_seed(self) -> int:
        # Dropout masks come from a seed drawn from PyTorch's generator: torch.manual_seed makes a
        # GraftModule run repeat. Models without Dropout leave PyTorch's generator untouched.
        if not self.has_dropout:
            return 0
        return int(torch.randint(0, 1 << 62, (1,)).item())


def _mark_padding_rows(model, module, e, edits):
    """torch.onnx.export drops nn.Embedding's padding_idx; graft's Gather takes it as its own
    attribute, so that row gets no gradient from the lookup, as in eager. Appends the attribute
    edits (node index, "padding_idx", row) for _graft.edit_onnx_graph."""
    name_of = {id(t): g for g, t in zip(e.param_inputs, e.current)}
    for mod in module.modules():
        if not isinstance(mod, torch.nn.Embedding) or mod.padding_idx is None:
            continue
        g = name_of.get(id(mod.weight))
        for i, (op, _, inputs, _, ints) in enumerate(model.nodes):
            if op == "Gather" and inputs and inputs[0] == g and ints.get("axis", 0) == 0 and "padding_idx" not in ints:
                ints["padding_idx"] = int(mod.padding_idx)
                edits.append((i, "padding_idx", int(mod.padding_idx)))


def _expose_batchnorm_state(model, module, e, counter_names, extra_outputs):
    """A training-mode BatchNormalization computes the updated running statistics (outputs 1, 2)
    but the exporter drops them (PyTorch updates the buffers in place). graft makes them extra graph
    outputs (appended to extra_outputs as (name, elem_type, dims)) and copies them into the buffers
    after each forward, and counts num_batches_tracked, so the module's state moves exactly as in
    eager."""
    slot_of = {g: i for i, g in enumerate(e.param_inputs)}
    by_name = dict(module.named_buffers())
    for op, _, inputs, outputs, ints in model.nodes:
        if op != "BatchNormalization" or not ints.get("training_mode", 0) or len(outputs) < 3:
            continue
        for k in (1, 2):
            buf_input = inputs[2 + k]
            if not outputs[k] or buf_input not in slot_of:
                continue
            c = e.current[slot_of[buf_input]]
            dtype = _export.DOUBLE if c.dtype == torch.float64 else _export.FLOAT
            extra_outputs.append((outputs[k], dtype, list(c.shape)))
            e.state_updates.append((outputs[k], ("slot", slot_of[buf_input])))
        owner = inputs[3][len(_export.PREFIX):].rpartition(".")[0]
        counter = f"{owner}.num_batches_tracked" if owner else "num_batches_tracked"
        if counter in by_name:
            counter_names.append(counter)


@dataclasses.dataclass
class _Prepared:
    """What the capture or the export hands back."""
    ex: Any = None                 # _export.Exported, its ONNX model dropped
    graph: Any = None              # the capture's graph for _graft.Session: (opset, inputs, outputs, nodes)
    float_outputs: List[str] = dataclasses.field(default_factory=list)
    state_updates: List[Tuple[str, Tuple[str, Any]]] = dataclasses.field(default_factory=list)  # as _Entry's
    counters: List[str] = dataclasses.field(default_factory=list)  # num_batches_tracked buffer names
    stops: bool = False  # the captured graph stops a gradient: torch.onnx.export is no way in
    hook_calls: list = dataclasses.field(default_factory=list)  # Note [forward hooks]
    weight_hooks: list = dataclasses.field(default_factory=list)  # Note [weight hooks] (_aten.py)
    free: list = dataclasses.field(default_factory=list)  # Note [free tensors] (_aten.py): fed after the call's
    free_check: Any = None                                # _aten.FreeTensors: whether they still are the same


def _bind_params(module, params, e):
    """Fills e.param_inputs / slots / current from the export's (graph input, state_dict name) pairs."""
    for gname, sname in params:
        owner_name, _, attr = sname.rpartition(".")
        owner = module.get_submodule(owner_name) if owner_name else module
        kind = "param" if attr in owner._parameters else "buffer"
        t = (owner._parameters if kind == "param" else owner._buffers)[attr]
        e.param_inputs.append(gname)
        e.slots.append((owner, attr, kind))
        e.current.append(t)


def _prepare(module, args, kwargs, tensors, path, opset, name) -> _Prepared:
    """Exports the module to `path` and edits the graph for GraftModule (padding rows, BatchNorm
    statistics as outputs)."""
    ex = _export.export(module, args, kwargs, tensors, path, opset, name)
    m = ex.model
    ex.model = None
    p = _Prepared(ex=ex)
    e = _Entry()
    _bind_params(module, ex.params, e)
    # Differentiate every float output, once each (a module may return one tensor twice).
    p.float_outputs = list(dict.fromkeys(o for o, t, _ in m.outputs if t in (_export.FLOAT, _export.DOUBLE)))
    edits, extra_outputs = [], []
    _mark_padding_rows(m, module, e, edits)
    _expose_batchnorm_state(m, module, e, p.counters, extra_outputs)
    if edits or extra_outputs:
        from . import _graft
        _graft.edit_onnx_graph(path, edits, extra_outputs)
    p.state_updates = e.state_updates
    return p


# GRAFT_EXPORT: how the forward becomes a graph. "capture" (the default): PyTorch's make_fx and
# functionalization (Note [capture], _aten.py), built into graft's IR with no file between, and
# torch.onnx.export only for what the capture cannot take; "onnx": torch.onnx.export alone (the
# fallback, forced: its tests and a comparison).
_EXPORT_MODES = ("capture", "onnx")


@contextlib.contextmanager
def _cyclic_collector_paused():
    """Python's cyclic garbage collector off while a graph is captured and built. The capture makes
    hundreds of thousands of objects (fx nodes, fake tensors, symbolic sizes), and each time they
    cross the collector's threshold it scans every object of the process, the model's and the
    libraries' included: 0.2-0.6 s of a 124M-parameter model's first call on torch 2.x. Reference
    counting still frees what it can; the cycles are collected after, by the next collection."""
    was = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was:
            gc.enable()


def _export_mode():
    mode = os.environ.get("GRAFT_EXPORT", "capture")
    if mode not in _EXPORT_MODES:
        raise GraftArgumentError(f"GRAFT_EXPORT={mode!r} is not one of {', '.join(_EXPORT_MODES)} (README, "
                                 "\"GraftModule\"); unset it for the default, capture", "invalid argument")
    return mode


def _capture_prepare(module, args, kwargs, tensors, opset, name, traces):
    """As _prepare, with PyTorch's own capture (Note [capture], _aten.py): from a trace in `traces`
    that fits the call (Note [dynamic shapes]), else from a new one, appended to it. Raises
    _aten.NotCaptured (GraftModule then exports) or GraftUnsupportedError (refused)."""
    state = _aten._state(module)
    tr = next((t for t in traces if t.fits(state, tensors)), None)
    if tr is None:
        tr = _aten.trace(module, args, kwargs, tensors, name)
        traces.append(tr)
    c = _aten.translate(tr, module, state, tensors, name)
    ex = _export.Exported(path=None, input_names=c.input_names, input_index=c.input_index, params=c.params,
                          output_names=c.output_names, output_template=c.output_template,
                          has_dropout=c.has_dropout, warnings=c.warnings)
    p = _Prepared(ex=ex, graph=(opset, c.inputs, c.outputs, c.nodes))
    user = set(c.output_names)
    p.float_outputs = list(dict.fromkeys(o for o, t, _ in c.outputs if o in user and t in (_export.FLOAT,
                                                                                           _export.DOUBLE)))
    p.state_updates = list(c.updates)
    p.stops = c.stops
    p.hook_calls = c.hook_calls
    p.weight_hooks = c.weight_hooks
    p.free, p.free_check = c.free, tr.free
    return p


class _Call:
    """What one call passes to the autograd Function besides tensors."""
    __slots__ = ("n_in", "training_run", "bf16", "box", "targets")

    def __init__(self, n_in, training_run, bf16=False, targets=()):
        self.n_in, self.training_run, self.bf16, self.box = n_in, training_run, bf16, None
        self.targets = targets  # per entry.state_updates: the tensor its new value is copied into


def _add_module_prefix(state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys, error_msgs):
    for k in [k for k in state_dict if k.startswith(prefix)]:
        state_dict[prefix + "module." + k[len(prefix):]] = state_dict.pop(k)


class GraftModule(torch.nn.Module):
    """Wraps `module` so that its forward and backward run in graft (see the module docstring).

    gradients: "hook" (default), "accumulate", "hold", or "step" with optimizer= a torch.optim
    optimizer over the module's parameters: each parameter is updated by that optimizer inside
    backward, the moment its gradient is complete, and no .grad is kept (the loop is
    ``loss = f(model(x)); loss.backward()`` with no optimizer.step() and no zero_grad(); learning-rate
    schedulers work as usual). opset: 13..17; check_finite: stop at the first op producing NaN/Inf;
    max_memory: refuse a plan above this many bytes (0: no limit); activation_budget: recompute
    forward values in backward so that the activation peak fits this many bytes (0: none; refused,
    naming the smallest reachable peak, when it cannot); cache_size: how many exports
    (input signatures) to keep, least recently used dropped first. precision: "fp32", or "bf16":
    matrix products (Linear, matmul, convolution, and their gradients) in bfloat16 on the CPU's AMX
    units with float32 accumulation, everything else (outputs, weights, gradients) float32; a call
    under ``torch.autocast("cpu", dtype=torch.bfloat16)`` runs so too. clip_grad_norm (with
    gradients="step"): every gradient is scaled by min(1, max / (norm + 1e-6)) before its update, the
    norm taken over all of the step's gradients, exactly as torch.nn.utils.clip_grad_norm_ before
    optimizer.step(): backward runs twice, the first pass computing only the norm (each gradient
    reduced and freed as it completes), the second replaying the forward (same Dropout masks).
    weights: a .safetensors path or a state_dict giving the module's tensors their values first,
    without a second copy of them (for a module built under graft.init_empty_weights(), its
    parameters on the meta device; Note [weights without a copy], _weights.py).
    """

    def __init__(self, module: torch.nn.Module, gradients: str = "hook", opset: int = 17,
                 check_finite: bool = False, max_memory: int = 0, cache_size: int = 8,
                 activation_budget: int = 0,
                 optimizer: "torch.optim.Optimizer" = None, precision: str = "fp32",
                 clip_grad_norm: float = 0.0, weights=None):
        super().__init__()
        if not isinstance(module, torch.nn.Module):
            raise GraftArgumentError(f"GraftModule wraps a torch.nn.Module, not {type(module).__name__}",
                                     "invalid argument")
        if isinstance(module, GraftModule):
            raise GraftArgumentError(f"{type(module.module).__name__} is already wrapped in a GraftModule; wrap it once",
                                     "invalid argument")
        if gradients not in MODES:
            raise GraftArgumentError(f"gradients must be 'hook', 'accumulate', 'hold' or 'step', not {gradients!r}",
                                     "invalid argument")
        if (gradients == "step") != (optimizer is not None):
            raise GraftArgumentError("gradients='step' needs optimizer= (the torch.optim optimizer graft applies "
                                     "inside backward), and optimizer= is only for gradients='step'",
                                     "invalid argument")
        if optimizer is not None and not isinstance(optimizer, torch.optim.Optimizer):
            raise GraftArgumentError(f"optimizer must be a torch.optim.Optimizer, not {type(optimizer).__name__}",
                                     "invalid argument")
        for what, v, lo in (("opset", opset, 13), ("max_memory", max_memory, 0), ("cache_size", cache_size, 1),
                            ("activation_budget", activation_budget, 0)):
            if isinstance(v, bool) or not isinstance(v, int) or v < lo:
                raise GraftArgumentError(f"{what} must be an integer >= {lo}, not {v!r}", "invalid argument")
        if isinstance(clip_grad_norm, bool) or not isinstance(clip_grad_norm, (int, float)) \
                or not math.isfinite(clip_grad_norm) or clip_grad_norm < 0:
            raise GraftArgumentError(f"clip_grad_norm must be a finite number >= 0, not {clip_grad_norm!r}",
                                     "invalid argument")
        if clip_grad_norm and gradients != "step":
            raise GraftArgumentError("clip_grad_norm= is for gradients='step' (updates inside backward); in the other "
                                     "modes call torch.nn.utils.clip_grad_norm_ before optimizer.step()",
                                     "invalid argument")
        if precision not in ("fp32", "bf16"):
            raise GraftArgumentError(f"precision must be 'fp32' or 'bf16', not {precision!r}", "invalid argument")
        if opset > 17:
            raise GraftArgumentError(f"opset must be 13..17, not {opset}", "invalid argument")
        name = type(module).__name__
        if weights is not None:  # Note [weights without a copy] (_weights.py)
            from ._weights import materialize
            materialize(module, weights, name)
        for n, p in list(module.named_parameters()) + list(module.named_buffers()):
            if p.is_floating_point():
                _dtype_ok(p, f"parameter '{n}'", name)
            _device_ok(p, f"parameter '{n}'", name)
        self.module = module
        self.gradients = gradients
        self.optimizer = optimizer
        self._step_flags = {"defer": False, "clip": float(clip_grad_norm), "last_norm": None}
        self.opset = opset
        self.check_finite = check_finite
        self.max_memory = max_memory
        self.activation_budget = activation_budget
        self.precision = precision
        self.cache_size = cache_size
        self._cache: "collections.OrderedDict[Any, _Entry]" = collections.OrderedDict()
        self._exports = 0
        # How many times the forward was traced (Note [dynamic shapes], _aten.py); the traces kept,
        # per call signature without the sizes, most recently used last.
        self.captures = 0
        self._traces: "collections.OrderedDict[Any, list]" = collections.OrderedDict()
        self.export_method = ""  # how the latest export was made: "capture" or "torch.onnx.export (...)"
        self._warned = set()
        self._under_ddp = False
        self._lock = threading.RLock()
        self._dummy = torch.zeros(0, requires_grad=True)  # makes outputs require grad (see forward)
        # Inside a parent module, load_state_dict reaches the wrapped module through this one: the
        # keys state_dict gave (the wrapped module's, no "module.") get that step back.
        self._register_load_state_dict_pre_hook(_add_module_prefix)

    # --- copy / pickle: the compiled state is dropped and rebuilt on the next call ---
    def __getstate__(self):
        state = dict(self.__dict__)
        state["_cache"] = collections.OrderedDict()
        state["_traces"] = collections.OrderedDict()
        state.pop("_lock", None)
        return state

    def __setstate__(self, state):
        super().__setstate__(state)
        self._lock = threading.RLock()

    def __getattr__(self, name):
        # Attributes GraftModule does not have are the wrapped module's (wrapped.config, as ORTModule).
        try:
            return super().__getattr__(name)
        except AttributeError:
            module = self.__dict__.get("_modules", {}).get("module")
            if module is None:
                raise
            return getattr(module, name)

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
        if self.gradients == "step":
            raise GraftError(
                f"{self._name()}: DistributedDataParallel does not work with gradients='step': each update "
                "would run before the gradient is averaged across processes. Use gradients='hook'.",
                "invalid argument")
        if self.gradients == "accumulate":
            raise GraftError(
                f"{self._name()}: DistributedDataParallel needs gradients='hook' (or 'hold'): with "
                "'accumulate' graft writes .grad directly, so DDP's allreduce hooks would never fire and "
                "gradients would not be averaged across processes.", "invalid argument")
        ddp = sys._getframe(1).f_locals  # DistributedDataParallel.__init__, where it asks
        if isinstance(ddp.get("self"), torch.nn.parallel.DistributedDataParallel) and self.gradients == "hook":
            if ddp.get("find_unused_parameters") and not ddp.get("static_graph"):
                raise GraftError(
                    f"{self._name()}: DistributedDataParallel(find_unused_parameters=True) does not work with "
                    "gradients='hook' (DDP looks for parameters in the autograd graph; graft delivers their "
                    "gradients itself). Pass find_unused_parameters=False or static_graph=True, or use "
                    "gradients='hold'.", "invalid argument")
            # Under DDP, parameters stay out of the autograd graph: their AccumulateGrad (where DDP's
            # hooks sit) then runs only when graft delivers, never a second time with no gradient.
            self._under_ddp = True
        try:
            return self.__dict__["_graft_ddp_ignore"]
        except KeyError:
            raise AttributeError("_ddp_params_and_buffers_to_ignore") from None

    @_ddp_params_and_buffers_to_ignore.setter
    def _ddp_params_and_buffers_to_ignore(self, value):
        self.__dict__["_graft_ddp_ignore"] = value

    def _name(self) -> str:
        return type(self.module).__name__

    def _warn_once(self, key, msg):
        if key not in self._warned:
            self._warned.add(key)
            warnings.warn(GraftWarning(f"{self._name()}: {msg}"), stacklevel=4)

    # --- building an entry ---
    def _build(self, args, kwargs, tensors, trace_key=None, capture=True) -> _Entry:
        name = self._name()
        mode = _export_mode()
        if capture and mode == "capture":
            traces = self._traces.pop(trace_key, [])
            self._traces[trace_key] = traces  # most recently used last
            while len(self._traces) > self.cache_size:
                self._traces.popitem(last=False)
            n = len(traces)
            try:
                try:
                    prep = _capture_prepare(self.module, args, kwargs, tensors, self.opset, name, traces)
                finally:  # a new trace counts, whether or not graft takes its graph
                    self.captures += len(traces) - n
                    del traces[:-self.cache_size]
                self.export_method = "capture"
                return self._build_from(prep, args, kwargs, tensors)
            except _aten.NotCaptured as why:
                self.export_method = f"torch.onnx.export (not captured: {why})"
            except GraftUnsupportedError as err:  # refused: neither graph would give eager's results
                raise GraftUnsupportedError(f"{name}: {err.message}", err.kind) from None
        why = self.export_method.partition("(not captured: ")[2][:-1]
        if not self.export_method.startswith("torch.onnx.export"):
            self.export_method = "torch.onnx.export"
        _aten.refuse_forward_hooks(self.module, name, "graft's capture did not take the module"
                                   + (f" ({why})" if why else ""))
        # The collector is paused over the build (_cyclic_collector_paused): torch 1.13's capture
        # (a forward on real tensors) that did not take the module leaves cycles holding its
        # activations; collect them before the exporter runs the forward again. (torch 2.x's
        # fake-tensor capture holds none; _entry collects after the export either way.)
        if _aten._TRACING_MODE == "real":
            gc.collect()
        # The exporter's file is only read while the session is built: nothing of it stays on disk.
        try:
            with tempfile.TemporaryDirectory(prefix="graft_") as tmp:
                path = os.path.join(tmp, "model.onnx")
                prep = _prepare(self.module, args, kwargs, tensors, path, self.opset, name)
                return self._build_from(prep, args, kwargs, tensors, path)
        except GraftError as err:
            # The exporter was the fallback: say first why the capture did not take the module.
            if not why or "graft's capture did not take" in err.message:
                raise
            raise type(err)(f"{err.message} (graft's capture did not take it first: {why})", err.kind,
                            err.node) from None

    def _build_from(self, prep, args, kwargs, tensors, path=None) -> _Entry:
        """The session for a captured graph (prep.graph) or an exported file (path)."""
        name = self._name()
        ex = prep.ex
        for msg, category, filename, lineno in ex.warnings:
            if category is None:
                warnings.warn(GraftWarning(msg), stacklevel=5)
            else:
                warnings.warn_explicit(msg, category, filename, lineno)
        e = _Entry()
        e.module_name, e.mode, e.optimizer = name, self.gradients, self.optimizer
        e.step_flags = self._step_flags
        e.input_names, e.input_index = ex.input_names, ex.input_index
        e.output_names, e.output_template, e.has_dropout = ex.output_names, ex.output_template, ex.has_dropout
        e.hook_calls = prep.hook_calls
        e.weight_hooks = prep.weight_hooks
        e.free, e.free_check = prep.free, prep.free_check
        module = self.module
        _bind_params(module, ex.params, e)
        e.refresh_trainable()
        trainable = {g for g, _ in e.trainable}
        freeze = [g for g in e.param_inputs if g not in trainable]
        fed = tensors + e.free  # Note [free tensors] (_aten.py): after the call's tensors
        in_tensors = [fed[i] for i in e.input_index]
        e.input_grads = [n for n, t in zip(e.input_names, in_tensors) if t.requires_grad and t.is_floating_point()]
        e.float_outputs = prep.float_outputs
        e.state_updates = prep.state_updates
        e.counters = [module.get_buffer(n) for n in prep.counters]
        from . import _graft, _pyfunc
        _pyfunc.install()  # what runs a custom autograd.Function's node (Note [PythonOp])
        try:
            e.session = _graft.Session(prep.graph if path is None else path, {}, e.float_outputs, freeze,
                                       e.input_grads, e.param_inputs, self.gradients, self.check_finite,
                                       self.max_memory, self.activation_budget, self.precision == "bf16")
            e.outputs_info = e.session.outputs_info()
        except GraftError as err:
            if path is None and not prep.stops and isinstance(
                    err, (GraftUnsupportedError, GraftInvalidModelError, GraftShapeError, GraftInternalError)):
                # graft cannot build a session from its own capture: export the module instead.
                self.export_method = f"torch.onnx.export (not captured: graft refused the capture: {err.message})"
                return self._build(args, kwargs, tensors, capture=False)
            msg = err.message.replace(f"{path}: ", "") if path else err.message
            # (op_type, name, inputs, outputs) of each node
            nodes = ([(n[0], n[2], n[3], n[4]) for n in prep.graph[3]] if path is None
                     else [n[:4] for n in _graft.read_onnx_graph(path)[2]])
            at = [n for n in nodes if n[1] == err.node and n[0] == "Constant"]
            if at:  # name what the constant feeds
                outs = set(at[0][3])
                users = [f"{n[0]} node '{n[1]}'" for n in nodes if outs & set(n[2])]
                if users:
                    msg += f" (the constant feeds {', '.join(users)})"
            if isinstance(err, GraftUnsupportedError):
                msg += ". Keep the submodule that uses it in eager mode, or rewrite it with ops graft supports."
            raise type(err)(f"{name}: {msg}", err.kind, err.node) from None
        return e

    def _entry(self, args, kwargs, tensors, key, trace_key) -> _Entry:
        with self._lock:
            entry = self._cache.get(key)
            if entry is not None and not (entry.params_current(self._name()) and
                                          (entry.free_check is None or entry.free_check.current())):
                del self._cache[key]
                entry = None
            if entry is not None:
                self._cache.move_to_end(key)
                return entry
            traced = self.captures
            with _cyclic_collector_paused():
                entry = self._build(args, kwargs, tensors, trace_key)
            # The exporter's trace, and torch 1.13's capture, ran the forward on real tensors with
            # autograd on; their traced modules, graph and outputs form reference cycles that hold
            # every activation of that forward until Python's cyclic collector happens to run (many
            # steps later: a training loop makes few Python objects). Collect them now, once per
            # trace or export, so that the first step does not hold the activations twice. torch
            # 2.x's capture runs on fake tensors (no data): its cycles hold no activations.
            if (self.captures != traced and _aten._TRACING_MODE == "real") or self.export_method != "capture":
                gc.collect()
            self._cache[key] = entry
            self._exports += 1
            while len(self._cache) > self.cache_size:
                self._cache.popitem(last=False)
            if self._exports > 2 * self.cache_size:
                self._warn_once("misses", f"exported {self._exports} times: every new input shape, dtype or "
                                "non-tensor argument value (and every change of a submodule's mode or plain "
                                "attributes) makes a new export. Pass values that vary as tensors, or raise "
                                "cache_size.")
            return entry

    @property
    def defer_step(self) -> bool:
        """gradients="step" with micro-batches: while True, backward accumulates each gradient into
        .grad (as eager's backward does) instead of updating; the first backward with it False
        adds its gradient to that .grad, updates, and sets .grad back to None. The loop:
        ``model.defer_step = i < k - 1; loss_i.backward()`` for i in range(k)."""
        return self._step_flags["defer"]

    @defer_step.setter
    def defer_step(self, value: bool):
        self._step_flags["defer"] = bool(value)

    @property
    def last_grad_norm(self):
        """gradients="step" with clip_grad_norm: the total norm of the last clipped step's gradients
        (what torch.nn.utils.clip_grad_norm_ returns); None before the first."""
        return self._step_flags["last_norm"]

    def saved_for_backward(self) -> List[Tuple[str, str, str, int]]:
        """What graft's forward keeps for the backward, for the most recently called graph:
        (value, op, node, bytes) per buffer, biggest first. Parameters and inputs are not counted
        (the caller holds them anyway), as PyTorch's autograd saves those by reference."""
        entry = self._latest_entry()
        return list(entry.session.saved_for_backward()) if entry else []

    def op_times(self) -> List[Tuple[str, str, float]]:
        """Wall time of each graft op in the last run of the most recently called graph (forward,
        then backward once it ran), in execution order: (node, op, seconds). Recorded only when
        the environment had GRAFT_PROFILE=1 as that graph's session was built (its first call);
        empty otherwise."""
        entry = self._latest_entry()
        return list(entry.session.op_times()) if entry else []

    def node_flops(self) -> List[Tuple[str, float]]:
        """(node, arithmetic FLOPs per run) of the most recently called graph's nodes, for rates
        beside op_times(): matrix products, convolutions and attention count; elementwise ops are
        0."""
        entry = self._latest_entry()
        return list(entry.session.node_flops()) if entry else []

    def _latest_entry(self):
        """The cache entry of the most recently called graph (None before the first call)."""
        with self._lock:
            return next(reversed(self._cache.values())) if self._cache else None

    def _target(self, kind, key, entry, tensors):
        if kind == "slot":
            return entry.current[key]
        if kind == "input":
            return tensors[key]
        return self.module.get_buffer(key)

    def forward(self, *args, **kwargs):
        name = self._name()
        from . import _graft
        if torch.get_num_threads() != _graft.num_threads():  # graft's team follows torch.set_num_threads
            _graft.set_num_threads(torch.get_num_threads())
        bf16 = self.precision == "bf16"
        if _autocast_cpu():
            if _autocast_cpu_dtype() == torch.bfloat16:
                bf16 = True
                self._warn_once("autocast", "torch.autocast(bfloat16): graft runs this module's matrix products in "
                                            "bfloat16 with float32 accumulation; its outputs stay float32 (eager's "
                                            "matmul outputs would be bfloat16).")
            else:
                self._warn_once("autocast", f"torch.autocast({_autocast_cpu_dtype()}) is on, but graft has only "
                                            "bfloat16 matrix products: this module runs in float32 (outputs are float32).")
        try:
            tensors, static_key = _flatten.flatten_args((args, kwargs))
        except _flatten.Unkeyable as ex:
            raise GraftUnsupportedError(f"{name}: {ex}; pass tensors or plain values (numbers, strings, tuples, "
                                        "dicts, dataclasses of them)", "unsupported") from None
        sig = []
        for i, t in enumerate(tensors):
            _device_ok(t, f"input {i}", name)
            _dtype_ok(t, f"input {i}", name)
            sig.append((tuple(t.shape), t.dtype, t.requires_grad and t.is_floating_point()))
        state = _flatten.module_state(self.module)
        frozen = tuple(p.requires_grad for p in self.module.parameters())
        key = (static_key, tuple(sig), state, frozen)
        # The traces that may serve this call: same everything but the sizes (Note [dynamic shapes]).
        trace_key = (static_key, tuple((len(s), d, g) for s, d, g in sig), state, frozen)
        entry = self._entry(args, kwargs, tensors, key, trace_key)
        entry.calls += 1
        # A call tensor the module writes into (x.mul_(2) in its forward) is bound to graft as a copy:
        # its new value is written into the caller's tensor after the forward, while the backward
        # may still read the old one (a value recomputed from it, Note [pointwise recompute]).
        written = {key for _, (kind, key) in entry.state_updates if kind == "input"}
        fed = tensors + entry.free if entry.free else tensors  # Note [free tensors] (_aten.py)
        in_tensors = [fed[i].clone() if i in written else fed[i] for i in entry.input_index]
        training_run = torch.is_grad_enabled() and (bool(entry.trainable) or bool(entry.input_grads))
        params = entry.trainable_params() if training_run and not (self.gradients == "hook" and self._under_ddp) else []
        targets = [self._target(kind, key, entry, tensors) for _, (kind, key) in entry.state_updates]
        call = _Call(len(in_tensors), training_run, bf16, targets)
        outs = relay_outputs(GraftFunction.apply(entry, call, self._dummy, *in_tensors, *params), call)
        out = _flatten.rebuild(entry.output_template, iter(outs))
        if entry.weight_hooks:
            _aten.set_hook_weights(self.module, entry.weight_hooks)
        if entry.hook_calls:
            out, data = out
            self._fire_hooks(entry, data, name)
        return out

    def _fire_hooks(self, entry, data, name):
        """Note [forward hooks]: each forward (pre-)hook the capture recorded, called with this call's
        tensors (outputs of the graph, so a loss on them trains the module), in the recorded order.
        A hook that returns a value (a new input or output) is refused: the graph ran without it."""
        for (path, kind, key), args in zip(entry.hook_calls, data):
            m = self.module.get_submodule(path) if path else self.module
            fn = (m._forward_pre_hooks if kind == "pre" else m._forward_hooks).get(key)
            if fn is None:
                continue
            if fn(m, *args) is not None:
                where = f"'{path}'" if path else "the module itself"
                raise GraftUnsupportedError(
                    f"{name}: the forward {'pre-' if kind == 'pre' else ''}hook "
                    f"{getattr(fn, '__qualname__', type(fn).__name__)} on {where} returned a value (a new "
                    f"{'input' if kind == 'pre' else 'output'}); graft runs hooks after the graph, so it cannot use "
                    "it. Return None (record what you need), or keep that submodule in eager mode.", "unsupported")
