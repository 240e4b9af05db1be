"""GraftModule's capture of a module's forward, on PyTorch's own machinery (Note [capture]).

    tr = trace(module, args, kwargs, tensors, name)             # the aten graph (Note [dynamic shapes])
    captured = translate(tr, module, _state(module), tensors, name)  # as graft nodes, at the call's sizes

What it cannot take raises NotCaptured (GraftModule then tries torch.onnx.export, a documented
fallback); what graft must not run at all (module hooks, a custom autograd.Function) raises
GraftUnsupportedError.
"""
import contextlib
import operator
import traceback
import warnings
from typing import Any, Dict, List, Tuple

import torch
from torch.fx.experimental.proxy_tensor import make_fx
from torch.overrides import TorchFunctionMode

from . import _export, _flatten, _pyfunc
from .errors import GraftUnsupportedError

# Note [capture]
# GraftModule does not trace the forward itself. PyTorch's own pieces do, the two that
# torch.export and AOTAutograd are built from, on torch 1.13 and 2.x alike:
#
# * make_fx records every aten op the forward runs, below autograd (composite ops such as
#   F.linear or nn.MultiheadAttention already taken apart into addmm, bmm, _softmax...);
# * functionalization (torch._enable_functionalization) turns every in-place op and every write
#   through a view into an out-of-place op on a new value. A masked_fill_ into a tensor the forward
#   made is a masked_fill; a write into the caller's input or into a buffer is a new value the graph
#   returns, which GraftModule copies back after each call, as eager's forward writes it.
#
# Autograd stays on while the module runs (the tensors it sees require grad where the module's
# parameters and inputs do), so a TorchFunctionMode (_Watch) sees each call of the forward as eager
# runs it, with eager's requires_grad: where a call's inputs carry a gradient and its output does
# not (the call ran under torch.no_grad, or was detach() or .data), the output goes through graft's
# stop_gradient op, and graft's autodiff treats the value as a constant there, as eager does. A
# custom autograd.Function is seen by its backward node and refused (graft would differentiate the
# ops of its forward, not run its backward). Module hooks are refused before anything runs: a hook
# would run once, at the capture, and never again. A value read into Python (a branch, .item()) is
# refused where it comes from the inputs or the state: the graph would replay this call's value.
#
# torch 1.13 traces on the real tensors in one pass, the module under functionalization (its fake
# tensors do not work there). torch 2.x traces on fake tensors (shapes, no data: no compute and no
# memory at capture, as torch.export): first the module as it is, so that libraries asking "am I
# being traced" (Hugging Face's masks) see fake tensors and build masks from tensor ops instead of
# reading the mask, then that graph under functionalization (skipped where the first graph writes
# nothing: no op with a mutable schema, so functionalization would return it unchanged). Why not
# torch.export itself: it runs the same two pieces, but with autograd off in the graph it returns,
# so graft could no longer tell a torch.no_grad region from the rest; driving them directly gives
# one path on both versions.
#
# Then each aten op becomes graft nodes by a rule in _aten_rules.RULES (the aten -> graft table).
# An op whose operands are all constants (no input, parameter or buffer reaches it: a causal mask,
# position ids from arange) is computed here and becomes a Constant node. The module's buffers, the
# call's tensors and the RNG are left as they were.


class NotCaptured(Exception):
    """The capture cannot take this module (the reason in the message). exportable: whether
    torch.onnx.export may be tried instead (False where the forward stops a gradient, which the
    exporter's graph would not)."""

    def __init__(self, why, exportable=True):
        super().__init__(why)
        self.exportable = exportable


_lib = None  # graft's torch.library namespace (one DEF per namespace and process)
_defined = set()


def graft_op(name, schema, impls):
    """torch.ops.graft.<name>.default, defined in graft's library on first use: the ops of graft's
    own the capture traces (stop_gradient here, ctc_loss, _pyfunc's py_function). impls: dispatch
    key -> kernel."""
    global _lib
    if name not in _defined:
        if _lib is None:
            _lib = torch.library.Library("graft", "DEF")
        _lib.define(schema)
        for key, fn in impls.items():
            _lib.impl(name, fn, key)
        _defined.add(name)
    return getattr(torch.ops.graft, name).default


def _stop_gradient_op():
    """graft::stop_gradient(Tensor) -> Tensor, an op of graft's own that marks in the traced graph
    where eager's autograd stops a gradient (it computes a copy)."""
    return graft_op("stop_gradient", "stop_gradient(Tensor x) -> Tensor",
                    {"CompositeExplicitAutograd": lambda x: x.clone()})


def _leaves(x):
    if isinstance(x, (list, tuple)):
        for y in x:
            yield from _leaves(y)
    elif isinstance(x, dict):
        for y in x.values():
            yield from _leaves(y)
    else:
        yield x


def _custom_function(t):
    fn = getattr(t, "grad_fn", None)
    if isinstance(fn, torch.autograd.function.BackwardCFunction):
        return type(fn).__name__
    return None


_READ_FUNCS = tuple(getattr(torch.Tensor, n) for n in ("__bool__", "item", "tolist", "__int__", "__float__",
                                                      "__index__") if hasattr(torch.Tensor, n))


class _Watch(TorchFunctionMode):
    """Sees each torch call of the forward above autograd (Note [capture]).

    It also follows which values come from the call's inputs or the module's state and which from
    a random draw, so that a value read into Python (a branch, .item()) is told apart: from the
    inputs or state, refused (the trace would replay this call's value); a constant, read; a random
    draw, read and said (LayerDrop: graft replays this call's branch, as torch.onnx.export did)."""

    def __init__(self, stop, graph_tensors, state, fake=False):
        super().__init__()
        self.stop = stop
        self.fake = fake  # tracing fake tensors (torch 2.x)
        self.shadows = {}  # id(fake constant) -> (it, computes its call's real outputs, index): _shadow
        self.graph = {id(t): t for t in graph_tensors}   # values from the inputs or state (kept alive)
        self.random = {}                                  # values from a random draw
        self.warnings = []
        self.state = state  # the module's parameters and buffers, as they are
        self.free: Dict[int, torch.Tensor] = {}  # Note [free tensors]

    def _note_free(self, ins):
        """Note [free tensors]: records each tensor a call takes that the trace did not make and
        that is neither the call's nor the module's state."""
        made = _is_fake if self.fake else torch._is_functional_tensor
        seen = [t for t in ins if id(t) not in self.graph and not made(t)]
        if not seen or _in_dispatch():
            return
        for t in seen:
            if _state_slot(t, self.state) is not None:
                continue
            if t.requires_grad:
                raise GraftUnsupportedError(
                    f"the forward reads a tensor that requires grad but is neither an input nor a parameter of the "
                    f"module (shape {tuple(t.shape)}, a global, a closure or a plain attribute){_user_line()}; eager "
                    "would give it a gradient, graft cannot. Register it on the module (nn.Parameter) or pass it in "
                    "as an argument.", "unsupported")
            self.free[id(t)] = t
            self.graph[id(t)] = t

    def _read(self, func, t, args, kwargs):
        if id(t) in self.graph:
            raise GraftUnsupportedError(
                "the forward reads a tensor's value into Python (a branch `if tensor:`, .item(), .tolist()): graft "
                "trains one graph for every call, so it would replay the value of this call. Compute it with tensor "
                "ops (torch.where), pass it in as a plain argument, or keep this module in eager mode"
                f"{_user_line()}.", "unsupported")
        from torch.fx.experimental.proxy_tensor import disable_proxy_modes_tracing
        inner = torch._from_functional_tensor(t) if torch._is_functional_tensor(t) else t
        if _is_fake(inner):  # torch 2.x traces without data: only a constant has a value
            try:
                inner = self._value(t)
            except LookupError:
                inner = getattr(inner, "constant", None)
            if inner is None or id(t) in self.random:
                what = "a random draw (LayerDrop with p > 0)" if id(t) in self.random else "a value"
                raise GraftUnsupportedError(
                    f"the forward reads {what} into Python (a branch `if tensor:`, .item(), .tolist()); graft traces "
                    "the forward without data, as torch.export does, and trains one graph for every call. Compute "
                    "it with tensor ops (torch.where), pass it in as a plain argument, or keep this module in eager "
                    f"mode{_user_line()}.", "unsupported")
        elif id(t) in self.random:
            self.warnings.append(
                f"the forward branches on a random number{_user_line()}; graft replays the branch this call took on "
                "every call with these input shapes (eager draws it anew each call). If the branch matters "
                "(LayerDrop with p > 0), keep this module in eager mode.")
        if self.fake:
            from torch._subclasses.fake_tensor import unset_fake_temporarily
            with unset_fake_temporarily(), disable_proxy_modes_tracing():
                return func(inner, *args[1:], **kwargs)
        with disable_proxy_modes_tracing():
            return func(inner, *args[1:], **kwargs)

    def _shadow(self, func, args, kwargs, out):
        """On fake tensors, a call on constants only (a causal mask from torch.full and triu) is
        also computed on real tensors beside the trace, so that what the forward reads of it
        (nn.Transformer compares its mask with a causal one) has a value. It is computed when read
        (_value): a symbolic size it takes (Note [dynamic shapes]) is then made a constant of the
        trace (a guard), and only then."""
        if not all(self._has_value(x) for x in _leaves((args, kwargs)) if isinstance(x, torch.Tensor)):
            return
        from torch._subclasses.fake_tensor import unset_fake_temporarily
        from torch.fx.experimental.proxy_tensor import disable_proxy_modes_tracing
        done = []

        def real(x):
            if isinstance(x, torch.Tensor):
                return self._value(x)
            if isinstance(x, _SYMBOLIC):  # guards the size (int() specializes it)
                return _plain(x)(x)
            if isinstance(x, (list, tuple)):
                return type(x)(real(y) for y in x)
            return x

        def compute():
            if not done:
                ra, rk = real(tuple(args)), {k: real(v) for k, v in kwargs.items()}
                with unset_fake_temporarily(), disable_proxy_modes_tracing():
                    done.append(list(_leaves(func(*ra, **rk))))
            return done[0]
        for i, f in enumerate(_leaves(out)):
            if isinstance(f, torch.Tensor):
                self.shadows[id(f)] = (f, compute, i)

    def _has_value(self, t):
        hit = self.shadows.get(id(t))
        return hit is not None and hit[0] is t

    def _value(self, t):
        """The real value beside the trace of a constant fake tensor (_shadow); LookupError if none."""
        hit = self.shadows.get(id(t))
        if hit is None or hit[0] is not t:
            raise LookupError
        try:
            r = hit[1]()[hit[2]]
        except Exception:  # noqa: BLE001  (a call that needs the trace)
            raise LookupError from None
        if not isinstance(r, torch.Tensor) or _is_fake(r):
            raise LookupError
        return r

    def _follow(self, out, ins, func):
        dep = any(id(a) in self.graph for a in ins)
        rand = any(id(a) in self.random for a in ins) or getattr(func, "__name__", "") in RANDOM_OPS
        if dep or rand:
            for o in _leaves(out):
                if isinstance(o, torch.Tensor):
                    (self.graph if dep else self.random)[id(o)] = o

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        ins = [a for a in _leaves((args, kwargs)) if isinstance(a, torch.Tensor)]
        self._note_free(ins)
        if self.free:
            written = [args[0]] if args and _writes(func) else []
            written += [o for o in _leaves(kwargs.get("out")) if isinstance(o, torch.Tensor)]
            if any(id(t) in self.free for t in written):
                raise GraftUnsupportedError(
                    f"the forward writes into a tensor that is neither an input nor a buffer of the module (a global, "
                    f"a closure or a plain attribute){_user_line()}; graft's graph would not repeat the write. "
                    "Register it as a buffer (register_buffer), or keep this module in eager mode.", "unsupported")
        if func in _READ_FUNCS and ins:
            return self._read(func, ins[0], args, kwargs)
        for a in ins:
            custom = _custom_function(a)
            if custom:
                raise GraftUnsupportedError(
                    f"the forward calls a custom torch.autograd.Function ({custom}); graft would differentiate "
                    "the ops of its forward instead of running its backward. Keep the submodule that calls it "
                    "in eager mode.", "unsupported")
        if func is torch.nn.functional.dropout:
            # F.dropout below autograd is a bernoulli_ into an empty tensor on the CPU; native_dropout
            # is the same computation as one op, which graft runs as its fused Dropout (graft's own
            # mask, drawn from a seed PyTorch's generator gives each call).
            x, p, training, inplace = _dropout_args(*args, **kwargs)
            if training and 0 < p < 1 and not inplace:
                out = torch.ops.aten.native_dropout(x, p, True)[0]
                self._follow(out, ins, func)
                return out
        if _SDPA is not None and func is _SDPA and self.fake:
            out = _attention_with_dropout(*args, **kwargs)
            if out is not None:
                self._follow(out, ins, func)
                return out
        if func is torch.nn.functional.interpolate and self.fake:
            out = _interpolate_whole(*args, **kwargs)
            if out is not None:
                self._follow(out, ins, func)
                return out
        if func is torch.nn.functional.ctc_loss and self.fake:
            # torch 2.x's fake tensors cannot run aten::_ctc_loss (its log_alpha's shape depends on
            # the lengths' values): graft::ctc_loss, the per-sequence loss only, and PyTorch's
            # reduction around it, as aten::ctc_loss writes it.
            out = _ctc_loss_fake(*args, **kwargs)
            self._follow(out, ins, func)
            return self._mark(out, ins) if any(a.requires_grad for a in ins) else out
        out = func(*args, **kwargs)
        if self.fake and not any(id(a) in self.graph or id(a) in self.random for a in ins) \
                and getattr(func, "__name__", "") not in RANDOM_OPS:
            self._shadow(func, args, kwargs, out)
        self._follow(out, ins, func)
        if not any(a.requires_grad for a in ins):
            return out
        out = self._mark(out, ins)
        self._follow(out, ins, func)
        return out

    def _mark(self, out, ins):
        if isinstance(out, torch.Tensor):
            if out.is_floating_point() and not out.requires_grad and all(out is not a for a in ins):
                return self.stop(out)
            return out
        if isinstance(out, (tuple, list)) and any(isinstance(o, torch.Tensor) for o in out):
            return type(out)(self._mark(o, ins) for o in out)
        return out


_SDPA = getattr(torch.nn.functional, "scaled_dot_product_attention", None)  # torch >= 2.0


def _attention_op():
    """graft::attention: scaled-dot-product attention with dropout on the probabilities, which
    PyTorch's fused CPU kernel lacks (torch decomposes such a call into its math, with the T x T
    probabilities); graft's fused Attention has it (Note [attention dropout], attention.cpp)."""
    def meta(q, k, v, mask, p, causal, scale):
        return q.new_empty(tuple(q.shape[:-1]) + (v.shape[-1],))

    def real(q, k, v, mask, p, causal, scale):  # (outside a trace: PyTorch's own)
        if q.shape[1] != k.shape[1]:
            k = k.repeat_interleave(q.shape[1] // k.shape[1], 1)
            v = v.repeat_interleave(q.shape[1] // v.shape[1], 1)
        return torch.nn.functional.scaled_dot_product_attention(q, k, v, mask, p, causal, scale=scale)
    return graft_op("attention", "attention(Tensor q, Tensor k, Tensor v, Tensor? mask, float dropout_p, "
                                 "bool is_causal, float? scale) -> Tensor", {"CompositeExplicitAutograd": real,
                                                                             "Meta": meta})


def _attention_with_dropout(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None,
                            enable_gqa=False):
    """F.scaled_dot_product_attention with dropout as graft::attention (torch 2.x, fake tensors);
    None where PyTorch's own path is to be traced (no dropout, or what graft's kernel lacks)."""
    if not dropout_p or any(not isinstance(t, torch.Tensor) or t.dim() != 4 for t in (query, key, value)):
        return None
    if key.shape[1] != query.shape[1] and not (enable_gqa and query.shape[1] % key.shape[1] == 0):
        return None
    if attn_mask is not None and attn_mask.dtype not in (torch.bool, query.dtype):
        return None
    from ._pyfunc import _no_function_modes
    with _no_function_modes():
        out = _attention_op()(query, key, value, attn_mask, float(dropout_p), bool(is_causal),
                              None if scale is None else float(scale))
    if any(t is not None and t.requires_grad for t in (query, key, value, attn_mask)):
        out.requires_grad_(True)
    return out


# F.interpolate's aten ops, which graft runs as its Resize (_aten_layers._upsample). Traced with
# symbolic sizes, PyTorch's Python dispatcher takes each apart into index arithmetic and
# _unsafe_index (its decompositions for torch.compile); graft::upsample keeps the op whole.
# (mode, spatial rank) -> the aten op
_INTERPOLATE = {("nearest", 1): "upsample_nearest1d", ("nearest", 2): "upsample_nearest2d",
                ("nearest", 3): "upsample_nearest3d", ("nearest-exact", 1): "_upsample_nearest_exact1d",
                ("nearest-exact", 2): "_upsample_nearest_exact2d", ("nearest-exact", 3): "_upsample_nearest_exact3d",
                ("linear", 1): "upsample_linear1d", ("bilinear", 2): "upsample_bilinear2d",
                ("trilinear", 3): "upsample_trilinear3d", ("bicubic", 2): "upsample_bicubic2d"}


def takes_align_corners(op) -> bool:
    """Whether the upsampling aten op `op` (one of _INTERPOLATE's) takes align_corners."""
    return "nearest" not in op


def _upsample_op():
    """graft::upsample(x, the aten op's name, output size, align_corners, scales): one of _INTERPOLATE's."""
    def args(op, size, align, scales):
        return ([size] + ([align] if takes_align_corners(op) else [])
                + (list(scales) if scales else [None] * len(size)))

    def meta(x, op, size, align, scales):
        return x.new_empty(tuple(x.shape[:2]) + tuple(size))

    def real(x, op, size, align, scales):  # (outside a trace: PyTorch's own)
        return getattr(torch.ops.aten, op).default(x, *args(op, size, align, scales))
    return graft_op("upsample", "upsample(Tensor x, str op, SymInt[] size, bool align_corners, float[]? scales) "
                                "-> Tensor", {"CompositeExplicitAutograd": real, "Meta": meta})


def _interpolate_whole(input, size=None, scale_factor=None, mode="nearest", align_corners=None,
                       recompute_scale_factor=None, antialias=False):
    """F.interpolate as graft::upsample (torch 2.x's trace); None where F.interpolate is to run as
    it is (a mode graft::upsample lacks, or arguments it refuses)."""
    if not isinstance(input, torch.Tensor) or input.dim() < 3 or antialias or recompute_scale_factor:
        return None
    dim = input.dim() - 2
    op = _INTERPOLATE.get((mode, dim))
    if op is None or (size is None) == (scale_factor is None) or (align_corners is not None and not takes_align_corners(op)):
        return None
    sizes = list(size) if isinstance(size, (list, tuple)) else None if size is None else [size] * dim
    scales = list(scale_factor) if isinstance(scale_factor, (list, tuple)) else \
        None if scale_factor is None else [scale_factor] * dim
    if any(len(v) != dim for v in (sizes, scales) if v is not None):
        return None
    from torch._decomp.decompositions import upsample_compute_output_size
    from ._pyfunc import _no_function_modes
    osize = upsample_compute_output_size(input.size(), sizes, scales)
    with _no_function_modes():
        out = _upsample_op()(input, op, list(osize), bool(align_corners),
                             None if scales is None else [float(s) for s in scales])
    if input.requires_grad:
        out.requires_grad_(True)
    return out


def _ctc_op():
    return graft_op("ctc_loss", "ctc_loss(Tensor log_probs, Tensor targets, Tensor input_lengths, "
                                "Tensor target_lengths, int blank, bool zero_infinity) -> Tensor",
                    {"CompositeExplicitAutograd": lambda lp, tg, il, tl, blank, zi: torch.ops.aten._ctc_loss(
                        lp, tg, il, tl, blank, zi)[0],
                     "Meta": lambda lp, tg, il, tl, blank, zi: lp.new_empty((lp.shape[1],))})


def _ctc_loss_fake(log_probs, targets, input_lengths, target_lengths, blank=0, reduction="mean",
                   zero_infinity=False):
    if log_probs.dim() != 3:
        raise NotCaptured("ctc_loss of unbatched log_probs")

    def lengths(v):
        return v if isinstance(v, torch.Tensor) else torch.tensor(list(v), dtype=torch.int64)
    il, tl = lengths(input_lengths), lengths(target_lengths)
    res = _ctc_op()(log_probs, targets, il, tl, blank, zero_infinity)
    if zero_infinity:
        res = torch.where(res == float("inf"), torch.zeros((), dtype=res.dtype), res)
    if reduction == "mean":
        return (res / tl.clamp_min(1).to(res.dtype)).mean()
    return res.sum() if reduction == "sum" else res


def _in_dispatch() -> bool:
    """Whether this call comes from below autograd (a __torch_dispatch__: make_fx's tracer, or a
    composite op's parts, which torch 1.13 shows the mode too) rather than from the forward."""
    import sys
    f = sys._getframe(2)
    while f is not None:
        if f.f_code.co_name == "__torch_dispatch__":
            return True
        f = f.f_back
    return False


def _writes(func) -> bool:
    """Whether a torch function writes into its first argument (add_, x += 1, x[i] = v)."""
    name = getattr(func, "__name__", "")
    return (name.endswith("_") and not name.endswith("__")) or name == "__setitem__" or \
        (name.startswith("__i") and name.endswith("__") and name not in ("__index__", "__int__", "__invert__"))


def _is_fake(t):
    try:
        from torch._subclasses.fake_tensor import FakeTensor
    except ImportError:
        return False
    return isinstance(t, FakeTensor)


def _user_line(frames=None):
    """ ' (at file:line: source)' of the innermost of `frames` (by default the stack now) outside
    torch and graft, or ''."""
    import os
    import traceback
    skip = (os.path.dirname(torch.__file__), os.path.dirname(os.path.abspath(__file__)))
    frames = traceback.extract_stack() if frames is None else frames
    frames = [f for f in frames if not os.path.abspath(f.filename).startswith(skip)]
    return f" (at {frames[-1].filename}:{frames[-1].lineno}: {frames[-1].line})" if frames else ""


# Fused kernels of torch 2.x that graft runs as their definition (PyTorch's own decompositions into
# ops graft has rules for): the softmax of the attention's math path (a query whose keys are all
# masked gives 0). The CPU's fused attention itself maps to graft's (_aten_layers._sdpa_cpu).
_DECOMPOSE = ("_safe_softmax",)


# torch 2.x traces on fake tensors (shapes and dtypes, no data), as torch.export does: the forward
# costs no compute or memory at capture, and libraries that branch on "am I being traced"
# (Hugging Face's attention masks) build their masks from tensor ops instead of reading the mask's
# values. torch 1.13's fake tensors do not work under functionalization: it traces on the real ones.
_TRACING_MODE = "real" if torch.__version__.startswith("1.") else "fake"


def _decompositions():
    from torch._decomp import get_decompositions
    ops = [getattr(torch.ops.aten, n) for n in _DECOMPOSE if hasattr(torch.ops.aten, n)]
    return get_decompositions(ops)


# Note [functionalization in the graph]
# The second pass of Note [capture] (the first graph again, under functionalization) is a whole
# second make_fx trace: 1.3 of ResNet-50's 4.6 s first call, although all it changes there is
# what BatchNorm's running statistics, num_batches_tracked's add_ and the in-place ReLUs write. Where
# every write in the first graph is of a kind whose functional form is known and nothing else shares
# the storage written, the same rewrite is done on the graph itself, as functionalization would:
#
# * an in-place aten op `foo_.ov` (it writes its first argument and returns it) becomes `foo.ov`,
#   the op functionalization calls for it (same overload, same arguments);
# * `_native_batch_norm_legit` (it writes the running statistics) becomes
#   `_native_batch_norm_legit_functional`, whose two more outputs are the new statistics;
# * every later reader of the written value (through its name or the in-place op's result) reads
#   the new one, and the graph returns the final value of each input, parameter and buffer.
#
# "Nothing else shares the storage": no view (an op whose schema says its result aliases an
# argument) is written, and every view of a written storage is taken after its last write, so each
# view reads the final value, as it would in eager. A graph with another write (through a slice or
# a view taken before it, copy_ or index_put_ into a view, set_ and resize_, an op without a
# same-overload functional twin, a twin that _decompositions() would take apart, a write whose
# functional result has another dtype and would be cast back) is functionalized by PyTorch as
# before.
# `_FUNCTIONALIZE_IN_GRAPH = False` makes every graph take PyTorch's pass (the tests compare both).
_FUNCTIONALIZE_IN_GRAPH = True


# In-place ops that PyTorch's functionalization treats otherwise than "the functional twin, then
# replace": set_ keeps self an alias of its source, resize_ and resize_as_ change its metadata.
_FUNCTIONALIZED_APART = {"aten::set_", "aten::resize_", "aten::resize_as_"}


def _bn_legit():
    """(_native_batch_norm_legit, its functional form): torch 2.x's training-mode BatchNorm."""
    aten = torch.ops.aten
    return aten._native_batch_norm_legit.default, aten._native_batch_norm_legit_functional.default


def _functional_twin(target, schema):
    """(functional op, the argument indices target writes) where target is an in-place aten op whose
    functional form is known (Note [functionalization in the graph]); None otherwise."""
    written = [i for i, a in enumerate(schema.arguments) if a.alias_info is not None and a.alias_info.is_write]
    bn, bn_functional = _bn_legit()
    if target is bn:  # it writes running_mean and running_var
        return (bn_functional, written) if written == [3, 4] else None
    name, ov = schema.name, schema.overload_name or "default"
    if not name.startswith("aten::") or not name.endswith("_") or written != [0] or len(schema.returns) != 1:
        return None
    if name in _FUNCTIONALIZED_APART:
        return None
    packet = getattr(torch.ops.aten, name[len("aten::"):-1], None)
    twin = getattr(packet, ov, None) if packet is not None else None
    if twin is None:
        return None
    ta = twin._schema.arguments
    if [(a.name, str(a.type)) for a in ta] != [(a.name, str(a.type)) for a in schema.arguments] or \
            any(a.alias_info is not None for a in ta) or any(r.alias_info is not None for r in twin._schema.returns):
        return None
    return twin, written


def _promoted_dtype(op, n):
    """The dtype op gives on n's arguments (their dtypes and ranks, size-1 dims: type promotion only
    looks at those), or None where op does not run on such stand-ins."""
    def stand_in(a):
        tm = a.meta.get("tensor_meta")
        if tm is None:  # a symbolic size: a plain value of its kind (a real op on it would guard it)
            v = a.meta.get("val")
            return _plain(v)(1) if isinstance(v, _SYMBOLIC) else v
        return torch.empty((1,) * len(tm.shape), dtype=tm.dtype, device="meta")
    try:
        a, kw = torch.fx.node.map_arg((n.args, n.kwargs), stand_in)
        out = op(*a, **kw)
    except Exception:  # noqa: BLE001  (then PyTorch's functionalization decides)
        return None
    return out.dtype if isinstance(out, torch.Tensor) else None


def _functionalized_in_graph(gm, decompositions):
    """gm (the first trace: its outputs are the leaves, then each placeholder's tensor) with every
    write made a new value as functionalization does, or None where the graph has a write this
    does not take (Note [functionalization in the graph]). gm is changed only where it returns one."""
    from torch.fx.passes.shape_prop import _extract_tensor_metadata
    Node = torch.fx.Node
    bn_functional = _bn_legit()[1]
    nodes = list(gm.graph.nodes)
    base, plan = {}, {}
    views = set()  # nodes whose result is a view (shares an argument's storage)
    first_view, last_write = {}, {}  # a storage's base -> the position of its first view / last write

    def tensor_args(n):
        out = []
        torch.fx.node.map_arg((n.args, n.kwargs), lambda a: out.append(a))
        return out

    for pos, n in enumerate(nodes):
        base[n] = n  # its own storage, unless it is a view or an in-place result (below)
        if n.op != "call_function":
            continue
        if n.target is operator.getitem:
            if n.args[0] in views:
                base[n] = base[n.args[0]]
            continue
        schema = getattr(n.target, "_schema", None)
        if schema is None:
            continue
        if schema.is_mutable:
            twin = _functional_twin(n.target, schema)
            if twin is None or twin[0] in decompositions:
                return None
            op, idx = twin
            args = list(n.args)
            if any(i >= len(args) or not isinstance(args[i], Node) for i in idx):
                return None  # a written argument given by keyword or not a tensor
            for i in idx:
                last_write[base[args[i]]] = pos
            old = n.meta.get("val")
            if op is bn_functional:  # (out, mean, rstd) as before, then the new running statistics
                if not isinstance(old, (tuple, list)) or len(old) != 3:
                    return None
                val = tuple(old) + tuple(args[i].meta.get("val") for i in idx)
            else:
                if not isinstance(old, torch.Tensor) or _promoted_dtype(op, n) != old.dtype:
                    return None  # functionalization would add a cast back to the written dtype
                val = old
                base[n] = base[args[0]]  # the in-place result is its first argument
            plan[n] = (op, val, [base[args[i]] for i in idx])
            continue
        if any(r.alias_info is not None for r in schema.returns):  # a view: its result shares storage
            views.add(n)
            for a in tensor_args(n):
                first_view.setdefault(base[a], pos)
    # A view of a written storage is taken only after its last write (it then reads the final value,
    # as each view of it would); a view is never written.
    if any(b in views or first_view.get(b, pos + 1) < w for b, w in last_write.items()):
        return None

    g = gm.graph
    current = {}  # a written storage's base -> the node holding its value now

    def now(a):
        b = base.get(a)
        return current.get(b, a) if b in last_write else a

    def set_meta(node, val, like):
        node.meta.update({k: v for k, v in like.meta.items() if k not in ("val", "tensor_meta")})
        node.meta["val"] = val
        if isinstance(val, torch.Tensor):
            node.meta["tensor_meta"] = _extract_tensor_metadata(val)

    for n in nodes:
        n.args = torch.fx.node.map_arg(n.args, now)
        n.kwargs = torch.fx.node.map_arg(n.kwargs, now)
        if n not in plan:
            continue
        op, val, bases = plan[n]
        with g.inserting_before(n):
            new = g.call_function(op, n.args, n.kwargs)
            set_meta(new, val, n)
            if op is bn_functional:  # (out, mean, rstd, new running mean, new running var)
                for k, b in enumerate(bases):
                    item = g.call_function(operator.getitem, (new, 3 + k))
                    set_meta(item, val[3 + k], n)
                    current[b] = item
                n.replace_all_uses_with(new)
            else:
                current[bases[0]] = new
    for n in reversed(nodes):
        if n in plan:
            assert not n.users, n.format_node()
            g.erase_node(n)
    g.lint()
    gm.recompile()
    return gm


def _dropout_args(input, p=0.5, training=True, inplace=False):
    return input, p, training, inplace


def _drop(_):
    return None


FORWARD_HOOKS = (("_forward_pre_hooks", "pre"), ("_forward_hooks", "forward"))


def forward_hooks(module):
    """(path, kind, hook key) of every forward (pre-)hook on module and its submodules, in order
    (GraftModule's cache key has their keys from _flatten.module_state's walk)."""
    return tuple((path, kind, key) for path, m in module.named_modules() for attr, kind in FORWARD_HOOKS
                 for key in getattr(m, attr, {}) or {})


def refuse_forward_hooks(module, name, why):
    """For the exporter's path, which would run a forward hook once, at the export."""
    found = forward_hooks(module)
    if found:
        path, kind, _ = found[0]
        where = f"'{path}'" if path else "the module itself"
        raise GraftUnsupportedError(f"{name}: a forward {'pre-' if kind == 'pre' else ''}hook is registered on {where}, "
                                    f"and {why}; torch.onnx.export would run it once, at the export, and never again. "
                                    "Remove the hook, or keep that submodule in eager mode.", "unsupported")


def _weight_hook_classes():
    from torch.nn.utils.spectral_norm import SpectralNorm
    from torch.nn.utils.weight_norm import WeightNorm
    return (SpectralNorm, WeightNorm)


def weight_hooks(module):
    """Note [weight hooks]: (path, key) of each forward pre-hook of torch.nn.utils.weight_norm /
    spectral_norm (the older API; the newer one, torch.nn.utils.parametrizations, is plain forward
    code). Such a hook computes the weight the module's forward reads (setattr of a plain tensor
    attribute) and, for spectral_norm in training, updates its u and v buffers in place: it is part
    of what the forward computes, so the capture traces it inline (its buffer writes come back as
    eager's do, Note [capture]) instead of recording it. After each call GraftModule sets the
    attribute as eager's hook leaves it (compute_weight from the updated state)."""
    classes = _weight_hook_classes()
    return [(path, key) for path, m in module.named_modules()
            for key, fn in (getattr(m, "_forward_pre_hooks", None) or {}).items() if isinstance(fn, classes)]


def set_hook_weights(module, hooks):
    """Note [weight hooks]: the attribute each weight hook sets, as eager's call leaves it."""
    from torch.nn.utils.spectral_norm import SpectralNorm
    for path, key in hooks:
        m = module.get_submodule(path) if path else module
        fn = m._forward_pre_hooks.get(key)
        if fn is None:
            continue
        w = fn.compute_weight(m, do_power_iteration=False) if isinstance(fn, SpectralNorm) else fn.compute_weight(m)
        setattr(m, fn.name, w)


@contextlib.contextmanager
def _recording_hooks(module, name, calls, data):
    """Note [forward hooks]: while the capture traces, each forward (pre-)hook of the module tree
    is replaced by a recorder of its arguments (their tensors become graph outputs); GraftModule
    calls the real hook after each call with the real tensors. The hooks are restored after.
    Weight hooks (Note [weight hooks]) run inline; the attributes they set are put back after."""
    swapped, attrs = [], []
    inline = _weight_hook_classes()
    for path, m in module.named_modules():
        for attr, kind in FORWARD_HOOKS:
            hooks = getattr(m, attr, None)
            if not hooks:
                continue
            with_kwargs = getattr(m, attr + "_with_kwargs", None) or {}
            for key in list(hooks):
                if kind == "pre" and isinstance(hooks[key], inline) and key not in with_kwargs:
                    attrs.append((m, hooks[key].name, m.__dict__.get(hooks[key].name, attrs)))
                    continue
                if key in with_kwargs:
                    raise GraftUnsupportedError(
                        f"{name}: a forward hook registered with with_kwargs=True on '{path}' is not supported by "
                        "graft; register it without, or keep that submodule in eager mode.", "unsupported")

                def rec(mod, args, *output, _k=(path, kind, key)):
                    calls.append(_k)
                    data.append((args,) + output)
                swapped.append((hooks, key, hooks[key]))
                hooks[key] = rec
    try:
        yield
    finally:
        for hooks, key, fn in swapped:
            hooks[key] = fn
        for m, attr, value in attrs:  # (attrs itself: there was none)
            if value is attrs:
                m.__dict__.pop(attr, None)
            else:
                m.__dict__[attr] = value


def _refuse_early(module, name):
    """What is refused before anything runs: global module hooks (captured, they would run once and
    never again: Note [capture]), backward hooks of the deprecated kind (register_backward_hook) and
    a cumulative-average BatchNorm. Forward hooks run after each call (Note [forward hooks]), full
    backward hooks in graft's backward (Note [backward hooks], _pyfunc.py)."""
    import torch.nn.modules.module as mm
    glob = [n for n in ("_global_forward_hooks", "_global_forward_pre_hooks", "_global_backward_hooks",
                        "_global_backward_pre_hooks") if getattr(mm, n, None)]
    if glob:
        raise GraftUnsupportedError(
            f"{name}: a global module hook is registered (torch.nn.modules.module.register_module_{glob[0][8:-1]}); "
            "graft would run it once, at the capture, and never again. Remove it while GraftModule runs.",
            "unsupported")
    for path, m in module.named_modules():
        if isinstance(m, torch.nn.modules.batchnorm._BatchNorm) and m.training and m.track_running_stats \
                and m.momentum is None:
            raise GraftUnsupportedError(
                f"{name}: BatchNorm '{path}' has momentum=None (a cumulative average, whose factor eager reads "
                "from num_batches_tracked into Python each call); graft would replay this call's factor. Give it a "
                "momentum, or keep this module in eager mode.", "unsupported")
        if m._backward_hooks and getattr(m, "_is_full_backward_hook", None) is False:
            fn = next(iter(m._backward_hooks.values()))
            fname = getattr(fn, "__qualname__", type(fn).__name__)
            where = f"'{path}' ({type(m).__name__})" if path else f"the module itself ({type(m).__name__})"
            raise GraftUnsupportedError(
                f"{name}: a backward hook ({fname}) is registered on {where} with register_backward_hook, whose "
                "gradients are those of the module's last op (deprecated by PyTorch); graft runs the full backward "
                "hooks. Register it with register_full_backward_hook, or keep that submodule in eager mode.",
                "unsupported")


def _hooked(module):
    """(path, submodule) of each submodule with full backward (pre-)hooks (Note [backward hooks])."""
    return [(path, m) for path, m in module.named_modules()
            if m._backward_hooks or getattr(m, "_backward_pre_hooks", None)]


@contextlib.contextmanager
def _hook_boundaries(module):
    """Note [backward hooks] (_pyfunc.py): while the capture traces, each submodule with full
    backward (pre-)hooks runs between two identity graft nodes whose backward runs its hooks, on
    its positional tensors and on its outputs; PyTorch's own hook machinery is kept out of the trace
    (its hook dicts emptied), and all is put back after."""
    from collections import OrderedDict
    saved = []
    for path, m in _hooked(module):
        pre = getattr(m, "_backward_pre_hooks", None)
        saved.append((m, m._backward_hooks, pre, "forward" in m.__dict__))
        m._backward_hooks = OrderedDict()
        if pre is not None:
            m._backward_pre_hooks = OrderedDict()
        orig = m.forward

        def forward(*args, _m=m, _path=path, _orig=orig, **kwargs):
            key = None
            if any(isinstance(a, torch.Tensor) and a.requires_grad for a in args):
                key, args = _pyfunc.boundary(_m, _path, "in", args)
            out = _orig(*args, **kwargs)
            if not (isinstance(out, torch.Tensor) or (isinstance(out, (tuple, list))
                                                      and any(isinstance(o, torch.Tensor) for o in out))):
                raise GraftUnsupportedError(
                    f"the submodule {_path!r} has backward hooks and returns {type(out).__name__}; graft runs "
                    "backward hooks on a module that returns a tensor or a tuple / list of them, as eager does",
                    "unsupported")
            return _pyfunc.boundary(_m, _path, "out", out, pair=key, n_inputs=len(args))[1]
        m.forward = forward
    try:
        yield
    finally:
        for m, hooks, pre, had_forward in saved:
            m._backward_hooks = hooks
            if pre is not None:
                m._backward_pre_hooks = pre
            if not had_forward:
                del m.forward


def _state(module):
    """(name, tensor) of each parameter and buffer, each tensor once (the first name)."""
    seen, out = set(), []
    for n, t in list(module.named_parameters()) + list(module.named_buffers()):
        if id(t) not in seen:
            seen.add(id(t))
            out.append((n, t))
    return out


def _functional_call(module, state, args, kwargs):
    try:
        from torch.func import functional_call
    except ImportError:  # torch 1.13
        from torch.nn.utils.stateless import functional_call
    return functional_call(module, state, tuple(args), kwargs)


class Captured:
    """What the capture gives GraftModule: graft's nodes and how the call maps onto them."""

    def __init__(self):
        self.inputs: List[tuple] = []        # (graph input, ONNX elem type, dims)
        self.outputs: List[tuple] = []       # (graph output, elem type, dims): the user's, then updates
        self.nodes: List[tuple] = []         # (op, domain, name, inputs, outputs, attrs)
        self.input_names: List[str] = []     # graph inputs fed from the call's tensors
        self.input_index: List[int] = []     # their positions among the call's tensors
        self.params: List[Tuple[str, str]] = []  # (graph input, state name) of parameters and buffers
        self.output_names: List[str] = []    # the user's outputs
        self.output_template: Any = None
        self.has_dropout = False
        # After each call: (graph output, ("state", state name) | ("input", tensor index)), the new
        # value of a buffer or of a call tensor the forward wrote into.
        self.updates: List[Tuple[str, Tuple[str, Any]]] = []
        self.warnings: List[tuple] = []      # (message, None, None, None): for GraftModule to warn
        self.stops = False                   # the graph stops a gradient (no torch.onnx.export then)
        # Note [forward hooks]: (submodule path, "pre" | "forward", hook key) per hook call, in order;
        # the output template is then (the user's output, [(args[, output]) per call]).
        self.hook_calls: List[tuple] = []
        self.weight_hooks: List[tuple] = []  # Note [weight hooks]: (submodule path, hook key)
        # Note [free tensors]: fed after the call's tensors (input_index counts on from them).
        self.free: List[torch.Tensor] = []


PREFIX = _export.PREFIX  # graph inputs bound to module state: PREFIX + its state_dict name
_ELEM = {torch.float32: 1, torch.int64: 7, torch.int32: 6, torch.bool: 9, torch.float64: 11}


def elem(dtype, what="a value") -> int:
    e = _ELEM.get(dtype)
    if e is None:
        raise NotCaptured(f"{what} has dtype {dtype}")
    return e


# Note [dynamic shapes]
# On torch 2.x the call's tensors are traced with symbolic sizes (backed symbols in a ShapeEnv, as
# torch.compile's dynamic shapes; the module's parameters and buffers keep theirs), so one trace
# serves every batch size and sequence length. Where the forward decides something on a size (a
# branch, a reshape to a fixed width, PyTorch's own 0/1 specialization), the ShapeEnv records a
# guard, and the trace is reused only for calls whose sizes pass every guard (Trace.fits); another
# call is traced anew. graft's plan is per concrete shape: translate() builds graft's nodes from the
# same trace with each symbolic size evaluated at the call's sizes (Trace.sizes), so a new sequence
# length costs a translation and graft's compile, not a trace of the module. torch 1.13 traces on
# the real tensors (its symbolic tracing is a prototype that functionalization does not support):
# a trace there fits only calls of its exact shapes.


# Note [free tensors]
# A tensor the forward reads that is neither the call's nor the module's state (a global such as a
# class-weight tensor for cross_entropy, a closure, a plain tensor attribute that is not a buffer)
# is read by eager at every call, with its value then. The trace records each (_Watch._note_free)
# and graft's graph takes it as an input, fed from that same tensor at every call: a change in
# place is seen as in eager. Where the capture found a name bound to it (a module attribute, a
# global of a forward's module, a closure variable of a forward), the name is checked at every
# call; a name bound to another tensor, or a tensor of another shape, means a new trace. Refused:
# such a tensor that requires grad (eager would give it a gradient), a write into one (graft would
# not repeat it), a read of its value into Python. Without this, torch 1.13's trace kept the first
# call's value as a constant (silently stale after a change) and torch 2.x's fake tensors refused
# the module.


class FreeTensors:
    """The free tensors of a trace (Note [free tensors]) and the names bound to them."""

    def __init__(self, tensors, modules):
        self.tensors = list(tensors)
        self.sigs = [(tuple(t.shape), t.dtype) for t in self.tensors]
        modules = list(modules) if self.tensors else []
        self.bindings = [_bindings(t, modules) for t in self.tensors]

    def current(self) -> bool:
        """Whether the tensors are still those the forward reads, with their shapes."""
        for t, sig, binds in zip(self.tensors, self.sigs, self.bindings):
            if (tuple(t.shape), t.dtype) != sig or any(read() is not t for read in binds):
                return False
        return True


def _bindings(t, modules):
    """A reader of each name bound to `t` that the capture can see: a module attribute, a global of a
    forward's module, a closure variable of a forward."""
    found, seen = [], set()

    def cell(c):
        try:
            return c.cell_contents
        except ValueError:  # emptied
            return None
    for m in modules:
        fn = getattr(type(m).forward, "__func__", type(m).forward)
        for d in (vars(m), getattr(fn, "__globals__", None)):
            if d is not None and id(d) not in seen:
                seen.add(id(d))
                found += [lambda d=d, k=k: d.get(k) for k, v in list(d.items()) if v is t]
        for c in getattr(fn, "__closure__", None) or ():
            if id(c) not in seen and cell(c) is t:
                seen.add(id(c))
                found.append(lambda c=c: cell(c))
    return found


class Trace:
    """One trace of the forward, before translation (Note [dynamic shapes])."""

    def __init__(self, gm, box, stops, fakes, shape_env, state, tensors):
        self.gm, self.box, self.stops = gm, box, stops
        self.fakes, self.shape_env = fakes, shape_env  # None on torch 1.13
        self.state_sig = [(n, tuple(t.shape), t.dtype) for n, t in state]
        self.call_sig = [(tuple(t.shape), t.dtype) for t in tensors]
        self.free = box["free"]  # set by every run of the forward
        self._guards = None

    def fits(self, state, tensors) -> bool:
        """Whether this trace is the forward's for a call with these state and call tensors."""
        if [(n, tuple(t.shape), t.dtype) for n, t in state] != self.state_sig or len(tensors) != len(self.call_sig):
            return False
        if not self.free.current():
            return False
        for t, (shape, dtype) in zip(tensors, self.call_sig):
            if t.dtype != dtype or t.dim() != len(shape):
                return False
        if self.fakes is None:
            return all(tuple(t.shape) == shape for t, (shape, _) in zip(tensors, self.call_sig))
        for t, f in zip(tensors, self.fakes[len(self.state_sig):]):  # sizes the ShapeEnv made constants
            if any(e.is_number and int(e) != n for e, n in zip(map(_expr, f.shape), t.shape)):
                return False
        if self._guards is None:
            self._guards = self.shape_env.produce_guards_expression(self.fakes) or ""
        flat = [t for _, t in state] + list(tensors)
        return not self._guards or bool(self.shape_env.evaluate_guards_expression(self._guards, flat))

    def sizes(self, state, tensors):
        """The concrete value of a size of this trace (a SymInt, SymFloat or SymBool) at the call's
        sizes; anything else as it is."""
        if self.fakes is None:
            return lambda x: x
        bindings = self.shape_env.bind_symbols(self.fakes, [t for _, t in state] + list(tensors))
        memo = {}

        def size(x):
            if not isinstance(x, _SYMBOLIC):
                return x
            e = x.node.expr
            v = memo.get(e)
            if v is None:
                r = e.xreplace(bindings)  # a plain int where e is one symbol
                if getattr(r, "free_symbols", None):  # a size of data (masked_select's): as traced
                    return x
                v = memo[e] = _plain(x)(r)
            return v
        return size


def _expr(d):
    """A size as a sympy expression (a plain int as a number)."""
    import sympy
    return d.node.expr if isinstance(d, torch.SymInt) else sympy.Integer(d)


def _symbolic_fakes(flat, n_state, dynamic):
    """Fake tensors for `flat` (the module's state, then the call's tensors): the state's with its
    sizes, the call's with symbolic ones where `dynamic` (Note [dynamic shapes]); and their ShapeEnv."""
    from torch._dynamo.source import LocalSource
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.fx.experimental.symbolic_shapes import DimDynamic, ShapeEnv, StatelessSymbolicContext
    env = ShapeEnv(duck_shape=False)  # equal sizes at the capture are not assumed equal later
    mode = FakeTensorMode(shape_env=env, allow_non_fake_inputs=True)  # Note [free tensors]
    fakes = [mode.from_tensor(t, static_shapes=True) for t in flat[:n_state]]
    for i, t in enumerate(flat[n_state:]):
        if not dynamic:
            fakes.append(mode.from_tensor(t, static_shapes=True))
            continue
        ctx = StatelessSymbolicContext(dynamic_sizes=[DimDynamic.DYNAMIC] * t.dim())
        fakes.append(mode.from_tensor(t, source=LocalSource(f"input_{i}"), symbolic_context=ctx))
    return fakes, env


def trace(module, args, kwargs, tensors, name) -> "Trace":
    """Traces module(*args, **kwargs) (its tensors flattened in `tensors`): the aten graph, before
    translation (Note [dynamic shapes])."""
    _refuse_early(module, name)
    stop = _stop_gradient_op()
    state = _state(module)
    names = [n for n, _ in state]
    call_ids = {id(t) for t in tensors}
    if any(id(t) in call_ids for _, t in state):
        raise NotCaptured("a call tensor that is also a parameter or buffer")
    n_state = len(state)
    box = {}

    origs = [t for _, t in state] + list(tensors)

    def run(flat):
        """The module on `flat` (state, then call tensors) with autograd live and the calls watched:
        (its output leaves, the tensors it was given, written into where it wrote)."""
        for t, orig in zip(flat, origs):
            if orig.requires_grad and orig.is_floating_point() and not t.requires_grad:
                t.requires_grad_(True)
        st = dict(zip(names, flat[:n_state]))
        a, kw = _flatten.rebuild((args, kwargs), iter(flat[n_state:]))
        watch = _Watch(stop, flat, state, fake=_TRACING_MODE == "fake")
        # oneDNN off: torch 2.x runs nn.LSTM / nn.GRU as one mkldnn_rnn_layer op per layer with it
        # on, and as the cells' ops (which graft has) without; the values are the same.
        calls, data = [], []
        with torch.enable_grad(), torch.autograd.graph.saved_tensors_hooks(_drop, _drop), \
                torch.backends.mkldnn.flags(enabled=False), watch, _pyfunc.watched(watch, module, dict(state)), \
                _recording_hooks(module, name, calls, data), _hook_boundaries(module):
            out = _functional_call(module, st, a, kw)
        box["warnings"] = watch.warnings
        box["free"] = FreeTensors(watch.free.values(), module.modules())
        box["hook_calls"] = calls
        if calls:  # the hooks' arguments are outputs too: (the user's output, [(args[, output]) per call])
            out = (out, data)
        leaves = _flatten.flatten_outputs(out)
        for t in leaves:
            custom = _custom_function(t)
            if custom:
                raise GraftUnsupportedError(
                    f"the forward calls a custom torch.autograd.Function ({custom}); graft would "
                    "differentiate the ops of its forward instead of running its backward. Keep the "
                    "submodule that calls it in eager mode.", "unsupported")
        box["template"] = _flatten.rebuild(out, iter([torch.empty(0) for _ in leaves]))
        box["n_out"] = len(leaves)
        return list(leaves), flat

    def functionalized(fn):
        """fn(flat) -> (leaves, flat) under functionalization: every write a new value; returns the
        leaves and the final value of each of flat."""
        def f(*flat):
            torch._enable_functionalization(reapply_views=True)
            try:
                leaves, wrapped = fn([torch._to_functional_tensor(t) for t in flat])
                res = []
                for t in leaves + list(wrapped):
                    torch._sync(t)
                    res.append(torch._from_functional_tensor(t))
                return tuple(res)
            finally:
                torch._disable_functionalization()
        return f

    def trace_flat(flat):
        """(the aten graph, the tensors it was traced on if fake, their ShapeEnv)"""
        if _TRACING_MODE == "real":  # torch 1.13: one pass, the module under functionalization
            return make_fx(functionalized(run), decomposition_table=_decompositions())(*flat), None, None
        # torch 2.x: the module on fake tensors as they are (Note [capture]), then that graph under
        # functionalization. The call's tensors have symbolic sizes (Note [dynamic shapes]); where
        # PyTorch's tracer cannot take them so, the trace is made again at the call's sizes.
        try:
            return trace_fake(*_symbolic_fakes(flat, n_state, dynamic=True))
        except Exception:  # noqa: BLE001  (a refusal, if any, is said by the trace at the call's sizes)
            torch.set_rng_state(rng)
            return trace_fake(*_symbolic_fakes(flat, n_state, dynamic=False))

    def trace_fake(flat, shape_env):
        first = make_fx(lambda *fl: tuple(x for part in run(list(fl)) for x in part),
                        decomposition_table=_decompositions(), tracing_mode="symbolic",
                        _allow_non_fake_inputs=True)(*flat)
        if not any(getattr(getattr(node.target, "_schema", None), "is_mutable", False)
                   for node in first.graph.nodes if node.op == "call_function"):
            return first, flat, shape_env  # nothing written: functionalization would give the same graph
        if _FUNCTIONALIZE_IN_GRAPH:
            gm = _functionalized_in_graph(first, _decompositions())
            if gm is not None:
                return gm, flat, shape_env
        n = box["n_out"]

        def again(wrapped):
            outs = first(*wrapped)
            return list(outs[:n]), wrapped
        gm = make_fx(functionalized(again), decomposition_table=_decompositions(), tracing_mode="symbolic",
                     _allow_non_fake_inputs=True)(*flat)
        return gm, flat, shape_env

    rng = torch.get_rng_state()
    # On torch 1.13 the trace computes on the real tensors: parameters as they are (nothing writes
    # them), buffers and call tensors as copies (an op that writes without saying so in its schema,
    # torch 1.13's BatchNorm statistics, must not change the module). Fake tensors need no copies.
    copy = _TRACING_MODE == "real"
    flat = [t.detach().clone() if copy and not isinstance(t, torch.nn.Parameter) else t.detach() for _, t in state]
    flat += [t.detach().clone() if copy else t.detach() for t in tensors]
    try:
        # Custom autograd.Functions become graft::py_function calls (Note [PythonOp], _pyfunc.py).
        with warnings.catch_warnings(), _pyfunc.intercept():
            warnings.filterwarnings("ignore", message="TF32 acceleration on top of oneDNN")  # torch 2.x
            gm, fakes, shape_env = trace_flat(flat)
    except (GraftUnsupportedError, NotCaptured):
        raise
    except _pyfunc.FunctionRaised as ex:  # a custom autograd.Function's forward raised: as in eager
        raise ex.original from None
    except Exception as ex:  # noqa: BLE001
        first = str(ex).strip().splitlines()[0] if str(ex).strip() else ""
        if "value out of a tracing tensor" in first or "data-dependent" in first:
            raise GraftUnsupportedError(
                "the forward reads a tensor's value into Python (a branch `if tensor:`, .item(), .tolist(), "
                "or a random draw deciding a branch, as LayerDrop): graft trains one graph for every call, so it "
                "would replay the value of this call. Compute it with tensor ops (torch.where), pass it in as a "
                f"plain argument, or keep this module in eager mode{_user_line(traceback.extract_tb(ex.__traceback__))}.", "unsupported") from None
        raise GraftUnsupportedError(f"PyTorch's tracer (make_fx) stopped in the forward: {type(ex).__name__}: "
                                    f"{first}", "unsupported") from ex
    finally:
        torch.set_rng_state(rng)
    del flat
    stops = any(getattr(n.target, "_schema", None) is not None and n.target._schema.name.split("::")[-1] in _STOPS
                for n in gm.graph.nodes if n.op == "call_function")
    return Trace(gm, box, stops, fakes, shape_env, state, tensors)


def translate(tr: "Trace", module, state, tensors, name) -> Captured:
    """Graft's nodes for a trace, at the sizes of the call's `tensors` (which tr.fits; state:
    _state(module))."""
    try:
        c = _translate(tr.gm, module, state, tensors, tr.box, name, tr.sizes(state, tensors))
        c.stops = tr.stops
        return c
    except NotCaptured as ex:
        if tr.free.tensors:
            raise GraftUnsupportedError(
                f"{ex}; and torch.onnx.export, graft's other way in, would keep this call's value of the tensors "
                "the forward reads that are neither inputs nor buffers (a global, a closure, a plain attribute)",
                "unsupported") from None
        if tr.stops:
            raise GraftUnsupportedError(
                f"{ex}; and torch.onnx.export, graft's other way in, would differentiate through the "
                "places where the forward stops a gradient (detach(), torch.no_grad, .data)", "unsupported") \
                from None
        raise


# --- aten graph -> graft nodes ---------------------------------------------------------------------
class _Builder:
    """Emits graft nodes; rules see graph values as meta tensors (shape, dtype) bound to names."""

    def __init__(self):
        self.nodes: List[tuple] = []
        self.names: Dict[int, Tuple[torch.Tensor, str]] = {}
        self.consts: Dict[int, Tuple[torch.Tensor, str]] = {}
        self.producer: Dict[str, tuple] = {}
        self.shapes: Dict[str, list] = {}
        self.updates: Dict[str, str] = {}  # state graph input -> its new value (torch 1.13's BatchNorm)
        self.has_dropout = False
        self.n = 0

    def fresh(self, hint="v"):
        self.n += 1
        return f"{hint}{self.n}"

    def bind(self, t, name):
        self.names[id(t)] = (t, name)
        self.shapes[name] = list(t.shape)

    def name_of(self, t):
        hit = self.names.get(id(t))
        return hit[1] if hit is not None and hit[0] is t else None

    def v(self, x, dtype=None):
        """The graph value of an op's argument, cast to dtype where given: a bound value, or a
        constant (a Constant node)."""
        if isinstance(x, torch.Tensor):
            name = self.name_of(x)
            if name is not None:
                if dtype is not None and x.dtype != dtype:
                    return self.emit("Cast", [name], attrs=[("to", "i", elem(dtype, "a cast"))])
                return name
            if x.device.type == "meta":
                raise NotCaptured("an internal value without a name")  # a rule's bug
            key = (id(x), None if dtype is None else str(dtype))
            hit = self.consts.get(key)
            if hit is not None and hit[0] is x:
                return hit[1]
            t = x if dtype is None else x.to(dtype)
            name = self.fresh("c")
            self.shapes[name] = list(t.shape)
            raw = t.detach().contiguous().numpy().tobytes()
            self.nodes.append(("Constant", "", f"{name}_Constant", [], [name],
                               [("value", "t", (elem(t.dtype, "a constant"), list(t.shape), raw))]))
            self.consts[key] = (x, name)
            return name
        if isinstance(x, (bool, int, float)):
            if dtype is None:
                dtype = torch.bool if isinstance(x, bool) else torch.int64 if isinstance(x, int) else torch.float32
            return self.v(torch.tensor(x, dtype=dtype))
        raise NotCaptured(f"an argument of type {type(x).__name__}")

    def ints(self, xs):
        return self.v(torch.tensor([int(x) for x in xs], dtype=torch.int64))

    def emit(self, op, inputs, outputs=None, attrs=(), nout=1, domain=""):
        names = outputs if outputs is not None else [self.fresh() for _ in range(nout)]
        self.nodes.append((op, domain, f"n{len(self.nodes)}_{op}", list(inputs), list(names), list(attrs)))
        for o in names:
            if o:
                self.producer[o] = (op, list(inputs), list(attrs))
        return names[0] if outputs is None and nout == 1 else names


def _meta(tm, size=lambda x: x):
    """Meta tensors (shape and dtype, no data) for a node's TensorMetadata (or a tuple of them), each
    symbolic size evaluated by `size` (Trace.sizes)."""
    if tm is None:
        return None
    if isinstance(tm, (tuple, list)) and not hasattr(tm, "dtype"):
        return type(tm)(_meta(x, size) for x in tm)
    shape = tuple(size(d) for d in tm.shape)
    stride = getattr(tm, "stride", None)
    if stride is not None and len(stride) == len(tm.shape):
        return torch.empty_strided(shape, tuple(size(d) for d in stride), dtype=tm.dtype, device="meta")
    return torch.empty(shape, dtype=tm.dtype, device="meta")


_SYMBOLIC = tuple(getattr(torch, n) for n in ("SymInt", "SymFloat", "SymBool") if hasattr(torch, n))


def _plain(x):
    """The Python type of a symbolic value's concrete ones: int, float or bool."""
    return int if isinstance(x, torch.SymInt) else float if isinstance(x, torch.SymFloat) else bool


def _is_graph_value(x):
    return isinstance(x, torch.Tensor) and x.device.type == "meta"


_STOPS = {"stop_gradient", "detach"}
# Ops whose result is random: never computed at capture time as a constant (graft would replay one
# draw on every call).
RANDOM_OPS = {"rand", "randn", "randint", "randperm", "bernoulli", "bernoulli_", "normal", "normal_",
              "uniform", "uniform_", "native_dropout", "dropout", "rand_like", "randn_like", "randint_like",
              "multinomial", "exponential", "exponential_", "random", "random_", "cauchy", "geometric",
              "log_normal", "attention"}


def _where(node):
    """The user's source line of an fx node, where the tracer kept it."""
    st = node.meta.get("stack_trace")
    if not st:
        return ""
    lines = [ln.strip() for ln in st.strip().splitlines() if ln.strip().startswith("File ")]
    return f" (at {lines[-1]})" if lines else ""


_READS = {"_local_scalar_dense", "is_nonzero", "equal", "item"}  # a tensor's value into Python


def _opname(node):
    op = getattr(node.target, "_schema", None)
    return op.name.split("::")[-1] if op is not None else ""


def _classify(gm, placeholders, out_node, name):
    """(the nodes the outputs depend on, warnings). A value read into Python (.item(), a branch)
    is baked into the graph by the trace: refused where it depends on the inputs or the module's
    state; said where it is a random draw (LayerDrop: graft replays this call's branch)."""
    graph = set(placeholders)
    random = set()
    warns = []
    for node in gm.graph.nodes:
        if node.op != "call_function":
            continue
        ins = node.all_input_nodes
        if any(i in graph for i in ins):
            graph.add(node)
        if _opname(node) in RANDOM_OPS or any(i in random for i in ins):
            random.add(node)
        if _opname(node) in _READS:
            if node in graph:
                raise NotCaptured(f"the forward reads a tensor value into Python (.item(), a branch on a tensor)"
                                  f"{_where(node)}")
            if node in random:
                warns.append((f"{name}: the forward branches on a random number{_where(node)}; graft replays the "
                              "branch this call took on every call with these input shapes (eager draws it anew "
                              "each call). If the branch matters (LayerDrop with p > 0), keep this module in eager "
                              "mode.", None, None, None))
    live = set()
    stack = list(out_node.all_input_nodes)
    while stack:
        n = stack.pop()
        if n not in live:
            live.add(n)
            stack.extend(n.all_input_nodes)
    return live, warns


def _state_slot(t, state):
    """The index in `state` of the parameter or buffer `t` is (the same memory and layout), or None."""
    if not isinstance(t, torch.Tensor):
        return None
    for k, (_, s) in enumerate(state):
        if s.data_ptr() == t.data_ptr() and s.shape == t.shape and s.stride() == t.stride() and s.dtype == t.dtype:
            return k
    return None


def _translate(gm, module, state, tensors, box, name, size) -> Captured:
    from . import _aten_rules as rules
    b = _Builder()
    c = Captured()
    vals: Dict[Any, Any] = {}
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    n_state = len(state)
    graph_names = [PREFIX + n for n, _ in state] + [f"input_{i}" for i in range(len(tensors))]
    free = box["free"].tensors
    for node, gname in zip(placeholders, graph_names):
        m = _meta(node.meta.get("tensor_meta"), size)
        b.bind(m, gname)
        vals[node] = m
    out_node = next(n for n in gm.graph.nodes if n.op == "output")
    live, warns = _classify(gm, placeholders, out_node, name)
    c.warnings = warns + [(f"{name}: {w}", None, None, None) for w in dict.fromkeys(box.get("warnings", ()))]
    for node in gm.graph.nodes:
        if node.op in ("placeholder", "output") or node not in live:
            continue
        if node.op == "get_attr":
            t = getattr(gm, node.target)
            j = next((j for j, f in enumerate(free) if f is t), None)
            if j is not None:  # Note [free tensors]: a graph input, fed from that tensor at every call
                m = torch.empty(t.shape, dtype=t.dtype, device="meta")
                b.bind(m, f"free_{j}")
                vals[node] = m
                continue
            k = _state_slot(t, state)
            # A parameter or buffer the forward reached other than through its module attribute
            # (nn.LSTM's cached _flat_weights on torch 1.13): the trace saw it as a constant; it is
            # the module's state, read as such.
            vals[node] = vals[placeholders[k]] if k is not None else t
            continue
        if node.op != "call_function":
            raise NotCaptured(f"an fx node of kind {node.op}")
        if isinstance(node.meta.get("val"), _SYMBOLIC):  # a size (Note [dynamic shapes]): at this call's sizes
            vals[node] = size(node.meta["val"])
            continue
        a, kw = torch.fx.node.map_arg((node.args, node.kwargs), lambda n: vals[n])
        if node.target is operator.getitem:
            vals[node] = a[0][a[1]]
            continue
        op = getattr(node.target, "_schema", None)
        opname = op.name.split("::")[-1] if op is not None else str(node.target)
        if not any(_is_graph_value(x) for x in _leaves((a, kw))):
            if opname not in RANDOM_OPS:
                vals[node] = node.target(*a, **kw)  # constants only: computed here (Note [capture])
                continue
            if opname not in rules.RULES:  # a draw graft cannot make anew each call: never baked in
                raise NotCaptured(f"random numbers (aten::{opname}) feed the graph{_where(node)}")
        out = _meta(node.meta.get("tensor_meta"), size)
        if out is None:  # several outputs (torch 1.13 keeps no metadata for those): from their readers
            got = {u.args[1]: _meta(u.meta.get("tensor_meta"), size) for u in node.users
                   if u.target is operator.getitem}
            out = [got.get(i) for i in range(max(got) + 1)] if got else []
        if opname in _STOPS:
            made = b.emit("StopGradient", [b.v(a[0])], domain="graft")
        else:
            rule = rules.RULES.get(opname)
            if rule is None:
                raise NotCaptured(f"graft has no rule for the PyTorch op aten::{opname}{_where(node)}")
            try:
                made = rule(b, out, *a, **kw)
            except NotCaptured as ex:
                raise NotCaptured(f"aten::{opname}: {ex}{_where(node)}") from None
        if isinstance(out, (tuple, list)):
            made = list(made) if isinstance(made, (list, tuple)) else [made]
            for o, nm in zip(out, made):
                if o is not None and nm:
                    b.bind(o, nm)
            vals[node] = out
        else:
            b.bind(out, made if isinstance(made, str) else made[0])
            vals[node] = out
    # The outputs: the user's, then the new value of each parameter, buffer and call tensor.
    results = list(out_node.args[0])
    n_out = box["n_out"]
    user, final = results[:n_out], results[n_out:]
    used = set()
    for i, r in enumerate(user):
        t = vals[r] if isinstance(r, torch.fx.Node) else r
        if not isinstance(t, torch.Tensor):
            raise NotCaptured(f"output {i} is not a tensor")
        nm = b.v(t)
        if nm in used or nm in graph_names:
            nm = b.emit("Identity", [nm])
        used.add(nm)
        oname = f"output_{i}"
        b.nodes.append(("Identity", "", f"out_{i}", [nm], [oname], []))
        c.outputs.append((oname, elem(t.dtype, f"output {i}"), list(t.shape)))
        c.output_names.append(oname)
    for k, (r, ph) in enumerate(zip(final, placeholders)):
        gname = graph_names[k]
        new = b.updates.get(gname)
        if new is None:
            if r is ph:
                continue
            t = vals[r] if isinstance(r, torch.fx.Node) else r
            new = b.v(t, dtype=ph.meta["tensor_meta"].dtype)
        if k < n_state and isinstance(state[k][1], torch.nn.Parameter):
            raise NotCaptured(f"the forward writes into parameter '{state[k][0]}'")
        oname = f"update_{k}"
        b.nodes.append(("Identity", "", f"upd_{k}", [new], [oname], []))
        tm = ph.meta["tensor_meta"]
        c.outputs.append((oname, elem(tm.dtype, f"'{gname}'"), [size(d) for d in tm.shape]))
        c.updates.append((oname, ("state", state[k][0]) if k < n_state else ("input", k - n_state)))
    c.nodes = _live(b.nodes, {o for o, _, _ in c.outputs})
    read = {i for n in c.nodes for i in n[3]}
    for k, (gname, ph) in enumerate(zip(graph_names, placeholders)):
        if gname not in read:
            continue
        tm = ph.meta["tensor_meta"]
        what = f"parameter '{state[k][0]}'" if k < n_state else f"input {k - n_state}"
        c.inputs.append((gname, elem(tm.dtype, what), [size(d) for d in tm.shape]))
        if k < n_state:
            c.params.append((gname, state[k][0]))
        else:
            c.input_names.append(gname)
            c.input_index.append(k - n_state)
    for j, t in enumerate(free):
        if f"free_{j}" in read:
            c.inputs.append((f"free_{j}", elem(t.dtype, f"a free tensor of shape {tuple(t.shape)}"), list(t.shape)))
            c.input_names.append(f"free_{j}")
            c.input_index.append(len(tensors) + len(c.free))
            c.free.append(t)
    c.output_template = box["template"]
    c.hook_calls = list(box.get("hook_calls", ()))
    c.weight_hooks = weight_hooks(module)
    c.has_dropout = b.has_dropout
    return c


def _live(nodes, outputs):
    """The nodes the outputs depend on, in order."""
    need = set(outputs)
    keep = []
    for n in reversed(nodes):
        if any(o in need for o in n[4]):
            keep.append(n)
            need.update(n[3])
    keep.reverse()
    return keep
