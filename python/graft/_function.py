"""The autograd Function that runs a GraftModule call in graft, and how gradients leave it.

One Function per call; its context holds that call's graft step (the activations its backward
needs), so several forwards may be in flight and a backward always pairs with its own forward.

Parameters are inputs of the Function (so ``torch.autograd.grad(loss, params)`` sees them), except
in "hook" mode under DistributedDataParallel. In backward, graft asks the autograd engine what it
will do with each parameter (``torch._C._will_engine_execute_node`` on the parameter's
AccumulateGrad node):

* it will accumulate it (``loss.backward()``): graft delivers the gradient the moment it is
  complete, per mode ("accumulate": in place into ``.grad``; "hook": through PyTorch's own
  AccumulateGrad, so tensor hooks and DDP's allreduce hooks fire during graft's backward;
  "hold": returned when graft's backward ends; "step": the user's optimizer updates the parameter
  with it at once, and no ``.grad`` is kept), and returns None for it;
* it captures it (``torch.autograd.grad(loss, params)``): graft returns the gradient and touches
  no ``.grad``;
* it does not need it (``backward(inputs=[x])``, ``autograd.grad(loss, x)``): nothing is written.

``backward(retain_graph=True)`` twice: graft frees activations as its backward goes (that is its
memory promise), so a second backward through a retained graph recomputes the forward from the
saved inputs with the same parameters (checked by version) and the same random stream, giving the
same gradients as eager. ``create_graph=True`` (double backward) is refused.
"""
import math
import os
import time

import torch

from . import _graft, _pyfunc
from .errors import GraftError, GraftUnsupportedError, with_context

DTYPES = {torch.float32: "float32", torch.float64: "float64", torch.int64: "int64", torch.int32: "int32",
          torch.bool: "bool"}


def spec(t: torch.Tensor):
    return (t.data_ptr(), list(t.shape), DTYPES[t.dtype])


def _trace(event):
    from . import frontend
    if frontend.TRACE is not None:
        frontend.TRACE.append((event, time.monotonic()))


def wrap_outputs(arrays, owners):
    """torch tensors over graft's output arrays, zero-copy. An output that aliases torch memory
    graft was given (an input passed through, a view of a parameter) is graft-external: the numpy
    array does not keep that memory alive, so it becomes a view of the torch tensor owning it."""
    out = []
    for a in arrays:
        if a is None:
            out.append(None)
            continue
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
    """A one-node graph whose backward hands each box's gradient to its parameter's AccumulateGrad.
    Unlike torch.autograd.backward(param, grad), no Python reference to a gradient is left when
    AccumulateGrad runs, so when .grad is None it adopts the buffer as eager PyTorch does."""

    @staticmethod
    def forward(ctx, boxes, *params):
        ctx.boxes = boxes
        return params[0].new_zeros(())

    @staticmethod
    def backward(ctx, _):
        return (None,) + tuple(box.pop() for box in ctx.boxes)


_ENGINE = getattr(torch.autograd.Variable, "_execution_engine", None)
_ONES = {}


def _deliver(params, boxes):
    """Runs the one-node graph of _Deliver: each box's gradient reaches its parameter's
    AccumulateGrad through the autograd engine, so the parameter's hooks (DDP's among them) fire.
    The engine is called as torch.autograd.backward calls it, without that wrapper's argument
    handling (about a fifth of a delivery's cost, per parameter per step); not
    torch.autograd.backward(param, grad) either: torch 2.x imports sympy, ~35 MB, for its shape
    check."""
    with torch.enable_grad():
        out = _Deliver.apply(boxes, *params)
    if _ENGINE is None:
        torch.autograd.backward(out)
        return
    one = _ONES.get(out.dtype)
    if one is None:
        one = _ONES[out.dtype] = torch.ones((), dtype=out.dtype)
    # (tensors, grad_tensors, keep_graph, create_graph, inputs, allow_unreachable, accumulate_grad)
    _ENGINE.run_backward((out,), (one,), False, False, (), True, True)


# Note [batched delivery]
# A delivery costs a custom Function's forward and a run of the autograd engine, whatever it carries
# (docs/performance.md, "Batched delivery of small gradients"). Small gradients (biases, norm
# weights: at most SMALL_GRAD bytes together) wait for the next gradient graft completes and go with
# it in one engine run; a larger one goes at once, so what waits is bounded by SMALL_GRAD bytes and
# delays no large gradient (DDP's buckets fill as before). Only gradients graft no longer holds wait
# (exclusive): a buffer graft still uses is delivered the moment it is complete. What waits when
# graft's backward ends (or fails) is delivered then, inside the backward.
SMALL_GRAD = 64 << 10


# Note [fused update in step mode]
# torch.optim.Adam and AdamW on the CPU default to their single-tensor update: five passes over the
# parameter and its moments (lerp_, mul_, addcmul_, sqrt / div / add_ into a temporary, addcdiv_).
# PyTorch (>= 2.4) ships the same update as one fused, vectorized, multi-threaded CPU kernel
# (fused=True, torch._fused_adamw_). Step mode applies the user's optimizer one parameter at a time
# inside backward, so it runs that kernel for the parameter: the same algorithm, hyperparameters and
# state tensors (state_dict is unchanged), rounding aside (the kernel orders its float operations
# otherwise; tests/python/test_frontend_semantics.py holds it to the eager loop at the suite's
# tolerances, as graft's products are). ~5x less time per update (docs/performance.md, "The
# optimizer's update in step mode"); on Llama-1B that is ~3 s of a ~22 s step. Only for the exact
# classes (a subclass may change step()), groups that are not differentiable or capturable, and a
# parameter that already has state: its first update runs the optimizer's own path, which creates
# the state as eager's first step does (the fused path would make `step` float32 under a float64
# default dtype). torch.optim.AdamW itself goes further, to graft's own kernel (Note [graft's update in
# step mode], below). GRAFT_FUSED_STEP=0 keeps the optimizer's own path throughout.
_FUSED_CLASSES = tuple(getattr(torch.optim, n) for n in ("Adam", "AdamW") if hasattr(torch.optim, n))


def _fused_on_cpu():
    try:
        from torch.optim.optimizer import _get_fused_kernels_supported_devices
        return "cpu" in _get_fused_kernels_supported_devices()
    except ImportError:  # torch 1.x: fused Adam is CUDA-only there
        return False


_FUSED_CPU = _fused_on_cpu()


def _fuses(opt, group, p):
    return (_FUSED_CPU and type(opt) in _FUSED_CLASSES and os.environ.get("GRAFT_FUSED_STEP", "1") != "0"
            and not group.get("fused") and not group.get("differentiable") and not group.get("capturable")
            and p.device.type == "cpu" and p.dtype in (torch.float32, torch.float64) and bool(opt.state.get(p)))


# Note [graft's update in step mode]
# Inside a training step, each call into torch's optimizer for one parameter cost far more than its
# arithmetic: ViT-B/16's 101 small parameters (biases, LayerNorm weights) took ~0.3 ms each in
# opt.step()'s Python and dispatch (the record_function, the hooks' chains, the step count's
# _foreach_add_, each cold after graft's kernels), ~30 ms of ~100 ms of updates per step, and the
# fused kernel ran the large ones at ~0.7-1.2 ns per parameter. For torch.optim.AdamW itself (not a
# subclass, not amsgrad or maximize, no step hooks, the instance's step not replaced except by an
# LR scheduler's counter), where the fused path above would run, graft applies the update with
# its own kernel on the optimizer's own state tensors instead: the step count advanced by one, the
# same decoupled formula (PyTorch 1.13's single-tensor order of operations: rounding aside, as for
# the fused kernel, and held to eager's loop by the same tests), on graft's threads, one call per
# parameter, p's version counter advanced as an in-place op would. The first update of a parameter
# still runs the optimizer's own path (it creates the state). An LR scheduler's check that
# optimizer.step() ran before it sees the call it expects (`_opt_called`). GRAFT_FUSED_STEP=0 keeps
# the optimizer's own path throughout.
_DTYPE_NAMES = {torch.float32: "float32", torch.float64: "float64"}


def _graft_adamw_state(opt, group, p, g):
    """The state graft's AdamW update may run on (Note [graft's update in step mode]), or None."""
    # where the fused path would run (class, switch, group settings, dtype, state), for AdamW alone
    if type(opt) is not getattr(torch.optim, "AdamW", None) or not _fuses(opt, group, p):
        return None
    if group.get("amsgrad") or group.get("maximize") or group.get("decoupled_weight_decay", True) is not True:
        return None
    if not all(isinstance(group[k], (float, int)) for k in ("lr", "eps", "weight_decay")) \
            or not all(isinstance(b, (float, int)) for b in group["betas"]):
        return None
    from torch.optim import optimizer as _opt
    if opt._optimizer_step_pre_hooks or opt._optimizer_step_post_hooks \
            or _opt._global_optimizer_pre_hooks or _opt._global_optimizer_post_hooks:
        return None
    own_step = opt.__dict__.get("step")
    if own_step is not None and not getattr(own_step, "_wrapped_by_lr_sched", False):
        return None
    st = opt.state[p]  # there (_fuses)
    step, m, v = st.get("step"), st.get("exp_avg"), st.get("exp_avg_sq")
    if not all(isinstance(t, torch.Tensor) for t in (step, m, v)):
        return None
    if step.dtype not in _DTYPE_NAMES or step.numel() != 1 \
            or step.device.type != "cpu" or not step.is_contiguous():
        return None
    for t in (p, g, m, v):
        if t.device.type != "cpu" or t.dtype != p.dtype or t.shape != p.shape or not t.is_contiguous():
            return None
    return st


def _step_one(opt, p, g, defer=False):
    """Step mode: applies `opt`'s update to parameter p alone, with gradient g, the moment graft
    completes g: the optimizer's step() over a one-parameter copy of p's group (its current
    hyperparameters: schedulers act on the real groups), so its per-parameter state is PyTorch's
    own. .grad is None afterwards; a .grad accumulated by deferred micro-batches (defer=True:
    accumulate only) is added first. A parameter the optimizer does not hold accumulates into
    .grad, as eager's AccumulateGrad would."""
    held = any(q is p for group in opt.param_groups for q in group["params"])
    if defer or not held:
        with torch.no_grad():
            if p.grad is None:
                p.grad = g.clone()
            else:
                p.grad.add_(g)
        return
    if p.grad is not None:
        with torch.no_grad():
            g = p.grad.add_(g)
    for group in opt.param_groups:
        if any(q is p for q in group["params"]):
            st = _graft_adamw_state(opt, group, p, g)
            if st is not None:  # Note [graft's update in step mode]
                if opt.__dict__.get("step") is not None:
                    opt._opt_called = True  # what the LR scheduler's counter around step() records
                b1, b2 = group["betas"]
                _graft.adamw_update(p.data_ptr(), g.data_ptr(), st["exp_avg"].data_ptr(), st["exp_avg_sq"].data_ptr(),
                                    p.numel(), _DTYPE_NAMES[p.dtype], st["step"].data_ptr(),
                                    _DTYPE_NAMES[st["step"].dtype], float(group["lr"]), float(b1), float(b2),
                                    float(group["eps"]), float(group["weight_decay"]))
                # An in-place change, as the optimizer's own ops would record it: a graph that saved
                # p before this update then fails its version check instead of using the new values.
                torch.autograd.graph.increment_version(p)
                p.grad = None  # as after the optimizer's own path below
                return
            one = dict(group)
            one["params"] = [p]
            if _fuses(opt, one, p):
                one["fused"], one["foreach"] = True, False
            groups, p.grad = opt.param_groups, g
            try:
                opt.param_groups = [one]
                with torch.no_grad():
                    opt.step()
            finally:
                opt.param_groups, p.grad = groups, None
            return


def _accumulate_grad_node(p):
    with torch.enable_grad():  # backward runs with grad mode off
        return p.expand_as(p).grad_fn.next_functions[0][0]


def _hide_hooks_from_none(p, acc):
    """torch >= 2.0 runs a leaf's tensor hooks even when the gradient reaching its AccumulateGrad
    is None (torch 1.x skipped them; pytorch#60796). graft returns None for a parameter whose
    gradient it delivered itself, so the engine would call the user's hooks again, with None.
    Hide them until the engine has visited the AccumulateGrad (its post hook puts them back)."""
    hooks = p._backward_hooks  # the live dict the engine's hook for p reads
    if not hooks:
        return
    saved = dict(hooks)
    hooks.clear()

    def restore(*_):
        handle.remove()
        added = dict(hooks)  # registered meanwhile: after the older ones, as register_hook orders them
        hooks.clear()
        hooks.update(saved)
        hooks.update(added)
    handle = acc.register_hook(restore)


def _targets(entry, params, dummy, in_graph):
    """Per trainable parameter: 'deliver', 'return' or 'skip' (see the module docstring)."""
    will = getattr(torch._C, "_will_engine_execute_node", None)
    if will is None:  # an old torch: plain backward() is the only case graft can tell
        return ["deliver"] * len(params)
    if not in_graph:
        try:
            return ["deliver" if will(_accumulate_grad_node(dummy)) else "skip"] * len(params)
        except RuntimeError:
            return ["skip"] * len(params)
    out = []
    for p in params:
        try:
            out.append("deliver" if will(entry.acc_node(p)) else "skip")
        except RuntimeError:  # "a leaf node was passed ... running autograd.grad()": captured
            out.append("return")
    return out


def run_forward(entry, tensors, seed, keep, bf16=False, copies=None):
    """Binds the parameters and runs graft's forward. Returns (step, outputs). A parameter stored
    otherwise than contiguously (channels_last) is bound as a contiguous copy made for this call,
    appended to `copies`, which the caller keeps until the step's backward has run."""
    sess = entry.session
    with entry.lock:  # binding is per session; the forward itself runs without the GIL
        for gname, p in zip(entry.param_inputs, entry.current):
            d = p.detach()
            if not d.is_contiguous():
                d = d.contiguous()
                if copies is None:
                    raise GraftError(f"parameter '{gname[2:]}' is not contiguous", "internal")
                copies.append(d)
            sess.bind_param(gname, d.data_ptr(), list(d.shape), DTYPES[d.dtype])
    inputs = {name: spec(t) for name, t in zip(entry.input_names, tensors)}
    return sess.forward(inputs, seed, keep, bf16)


def apply_state_updates(entry, arrays, targets):
    """Copies the new values the forward computed for module state (a training-mode BatchNorm's
    running statistics) and for call tensors it wrote into (targets, per entry.state_updates) into
    those tensors, and counts the forward in num_batches_tracked where the exporter made the graph,
    as eager's forward does."""
    if not entry.state_updates:
        return
    with torch.no_grad():
        for t, a in zip(targets, arrays):
            t.copy_(torch.from_numpy(a))
        for c in entry.counters:
            c.add_(1)


# Note [output gradients handed over]
# PyTorch's autograd engine holds a node's incoming gradients for its whole backward call. For
# GraftFunction that call is the entire model's backward, so the gradient of the module's output
# (with the loss outside the module: B x H for the seed's stack, B x T x vocab for a language
# model's logits) stayed alive to the end, where eager frees it after the last layer's backward
# has read it. So the outputs pass through _Relay, a node of their own: its backward puts the real
# gradients in a box and gives GraftFunction stride-0 zeros (no memory); after _Relay's backward
# returns the engine lets go of the real ones, GraftFunction's backward takes them out of the box
# and hands them to graft (sess.backward's `owned`), whose run holds the only reference and drops
# each after its last read. _Relay's outputs alias GraftFunction's (the same memory, no view
# bookkeeping, so in-place ops on them behave as on any tensor).
class _GradBox:
    __slots__ = ("index", "grads")

    def __init__(self, index):
        self.index, self.grads = index, None

    def take(self):
        g, self.grads = self.grads or [None] * len(self.index), None
        return g


_ZERO = {}


class _Relay(torch.autograd.Function):
    @staticmethod
    def forward(ctx, box, *outs):
        ctx.box = box
        ctx.metas = [(o.shape, o.dtype) for o in outs]
        ctx.set_materialize_grads(False)
        return tuple(torch.empty(0, dtype=o.dtype).set_(o) for o in outs)

    @staticmethod
    def backward(ctx, *grads):
        ctx.box.grads = list(grads)
        del grads
        zeros = []
        for shape, dtype in ctx.metas:
            z = _ZERO.get(dtype)
            if z is None:
                z = _ZERO[dtype] = torch.zeros((), dtype=dtype)
            zeros.append(z.expand(shape))
        return (None, *zeros)


def relay_outputs(outs, call):
    """The module's outputs through _Relay (Note [output gradients handed over]); those that need
    no gradient pass as they are."""
    index = [i for i, o in enumerate(outs) if o.requires_grad]
    if not index:
        return outs
    call.box = _GradBox(index)
    relayed = _Relay.apply(call.box, *[outs[i] for i in index])
    outs = list(outs)
    for i, r in zip(index, relayed):
        outs[i] = r
    return tuple(outs)


class GraftFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, entry, call, dummy, *tensors_and_params):
        n_in, training_run = call.n_in, call.training_run
        tensors = [t.detach().contiguous() for t in tensors_and_params[:n_in]]
        params = tensors_and_params[n_in:]
        seed = entry.draw_seed()
        pyops = {_pyfunc.TRAIN: training_run}  # custom autograd.Functions' graphs (Note [PythonOp])
        copies = []  # contiguous copies of channels_last parameters, read until the backward ends
        try:
            with _pyfunc.calls(pyops):
                step, arrays = run_forward(entry, tensors, seed, training_run, call.bf16, copies)
        except GraftError as ex:
            raise with_context(ex, entry.module_name) from None
        ctx.pyops, ctx.copies = pyops, copies
        n_user = len(entry.output_names)
        outs = wrap_outputs(arrays[:n_user], tensors + [p for p in entry.current])
        apply_state_updates(entry, arrays[n_user:], call.targets)
        del arrays
        ctx.entry, ctx.step, ctx.seed, ctx.n_in, ctx.n_params = entry, step, seed, n_in, len(params)
        ctx.call = call  # call.box: the real output gradients (relay_outputs)
        ctx.training_run = training_run
        ctx.bf16 = call.bf16  # a retained graph's recompute uses the same precision
        ctx.tensors = tensors
        ctx.versions = [p._version for p in entry.current]
        ctx.in_graph = bool(params)
        ctx.save_for_backward(dummy)  # reading it in backward tells a freed graph from a retained one
        ctx.mark_non_differentiable(*[o for o in outs if not o.is_floating_point()])
        return tuple(outs)

    @staticmethod
    def backward(ctx, *grad_outputs):
        ctx.pyops[_pyfunc.TRAIN] = True  # a retained graph's recompute keeps the Functions' graphs too
        with _pyfunc.calls(ctx.pyops):
            return GraftFunction._backward(ctx, *grad_outputs)

    @staticmethod
    def _backward(ctx, *grad_outputs):
        grad_outputs = list(grad_outputs)
        box = ctx.call.box
        if box is not None:  # Note [output gradients handed over]: the real ones came through _Relay
            for i, g in zip(box.index, box.take()):
                grad_outputs[i] = g
            del g
        entry = ctx.entry
        n_out = (None, None, None) + (None,) * (ctx.n_in + ctx.n_params)
        dummy, = ctx.saved_tensors  # raises, as eager does, on a second backward of a freed graph
        if torch.is_grad_enabled():
            raise GraftUnsupportedError(
                f"{entry.module_name}: backward with create_graph=True (double backward, gradient penalties "
                "through the module) is not supported by graft. Keep this module in eager mode for that.",
                "unsupported")
        if not ctx.training_run:  # nothing here needs a gradient (outputs require grad via the dummy)
            return n_out
        sess = entry.session
        step = ctx.step
        if not step.pending():  # the graph was retained and its backward already ran: recompute
            for p, v in zip(entry.current, ctx.versions):
                if p._version != v:
                    raise GraftError(
                        f"{entry.module_name}: one of the variables needed for gradient computation has been "
                        "modified by an inplace operation (a parameter changed since this forward); backward "
                        "through the retained graph would not match it.", "invalid argument")
            ctx.copies = []
            try:
                step, _ = run_forward(entry, ctx.tensors, ctx.seed, True, ctx.bf16, ctx.copies)
            except GraftError as ex:
                raise with_context(ex, entry.module_name) from None
        summed = {}  # an output returned twice gets the sum of both gradients
        for name, out_grad, (oname, dt, shape) in zip(entry.output_names, grad_outputs, entry.outputs_info):
            if name not in entry.float_outputs or out_grad is None:
                continue
            summed[name] = summed[name] + out_grad if name in summed else out_grad
        del grad_outputs, out_grad
        grads = {}
        owned = {}  # the output gradients: graft's backward takes them over (sess.backward empties this)
        for name, (oname, dt, shape) in zip(entry.output_names, entry.outputs_info):
            if name not in entry.float_outputs or name in grads:
                continue
            g = summed.pop(name, None)
            g = (g if g is not None else torch.zeros(shape, dtype=getattr(torch, dt))).detach().contiguous()
            grads[name] = (g.data_ptr(), list(g.shape), DTYPES[g.dtype])
            owned[name] = g
            del g
        summed.clear()
        trainable = entry.trainable_params()
        targets = _targets(entry, trainable, dummy, ctx.in_graph) if entry.mode != "hold" else ["return"] * len(trainable)
        returned = {}
        _trace("graft_backward_start")
        try:
            if entry.mode == "accumulate":
                for (name, p), t in zip(entry.trainable, targets):
                    pg = p.grad
                    if t == "deliver" and pg is not None and pg.is_contiguous() and pg.dtype == p.dtype \
                            and not pg.requires_grad and pg.shape == p.shape:
                        sess.bind_grad(name, pg.data_ptr(), list(pg.shape), DTYPES[pg.dtype])
                    else:
                        sess.bind_grad(name, None, [], "")
                try:
                    sess.backward(step, grads, None, owned)
                finally:
                    for (name, p), t in zip(entry.trainable, targets):
                        g = sess.take_grad(name)  # a buffer graft adopted as .grad: hand it over
                        sess.bind_grad(name, None, [], "")  # graft keeps no pointer to torch memory
                        if g is None:
                            continue
                        g = torch.from_numpy(g)
                        if t == "return":
                            returned[name] = g
                        elif t == "deliver":
                            if p.grad is None:  # in the parameter's own layout (channels_last), as eager's
                                p.grad = g if p.is_contiguous() else torch.empty_like(p).copy_(g)
                            else:  # p.grad was not usable in place (dtype / layout): add into it
                                p.grad.add_(g)
            elif entry.mode == "hook":
                by_name = dict(entry.trainable)
                target = {name: t for (name, _), t in zip(entry.trainable, targets)}

                waiting_params, waiting_boxes, waiting_bytes = [], [], [0]

                def flush():
                    if waiting_params:
                        params, boxes = waiting_params[:], waiting_boxes[:]
                        del waiting_params[:], waiting_boxes[:]
                        waiting_bytes[0] = 0
                        _deliver(params, boxes)

                def deliver(name, array, exclusive):
                    t = target.get(name, "skip")
                    if t == "return":
                        returned[name] = torch.from_numpy(array).clone() if not exclusive else torch.from_numpy(array)
                    elif t == "deliver":  # PyTorch's own accumulation path: AccumulateGrad, hooks, DDP
                        p = by_name[name]
                        if exclusive:  # graft keeps no other reference: AccumulateGrad may adopt it
                            box = [torch.from_numpy(array)]
                        else:  # graft keeps the buffer: AccumulateGrad must not adopt it (copy if .grad is None)
                            g = torch.from_numpy(array)
                            box = [g.clone() if p.grad is None else g]
                            del g
                        waiting_params.append(p)
                        waiting_boxes.append(box)
                        del box
                        # Note [batched delivery]
                        if exclusive and waiting_bytes[0] + array.nbytes <= SMALL_GRAD:
                            waiting_bytes[0] += array.nbytes
                        else:
                            flush()

                try:
                    sess.backward(step, grads, deliver, owned)
                finally:
                    flush()
            elif entry.mode == "step":
                by_name = dict(entry.trainable)
                target = {name: t for (name, _), t in zip(entry.trainable, targets)}
                defer, clip, coef = entry.step_flags["defer"], entry.step_flags["clip"], 1.0
                if clip and not defer:
                    # Global-norm clipping: a first pass computes only the norm of every gradient
                    # (with what deferred micro-batches accumulated in .grad), each freed as it completes.
                    sumsq = [0.0]

                    def norm(name, array, exclusive):
                        if target.get(name, "skip") == "deliver":
                            g = torch.from_numpy(array)
                            pg = by_name[name].grad
                            g = g + pg if pg is not None else g
                            sumsq[0] += float(torch.sum(g * g, dtype=torch.float64))

                    sess.backward(step, grads, norm)  # not owned: the second pass reads them again
                    sess.release(step)
                    total = math.sqrt(sumsq[0])
                    entry.step_flags["last_norm"] = total
                    coef = min(1.0, clip / (total + 1e-6))
                    ctx.copies = []
                    step, _ = run_forward(entry, ctx.tensors, ctx.seed, True, ctx.bf16, ctx.copies)  # again

                def update(name, array, exclusive):
                    t = target.get(name, "skip")
                    if t == "return":  # torch.autograd.grad asked for it: no update
                        returned[name] = torch.from_numpy(array).clone() if not exclusive else torch.from_numpy(array)
                    elif t == "deliver":
                        g = torch.from_numpy(array)
                        if coef < 1:
                            p = by_name[name]
                            with torch.no_grad():
                                if p.grad is not None:  # micro-batches' sum, then the scale
                                    g, p.grad = p.grad.add_(g), None
                                g = g.mul_(coef) if exclusive else g.mul(coef)
                        _step_one(entry.optimizer, by_name[name], g, defer)

                sess.backward(step, grads, update, owned)
            else:  # hold
                for name, _ in entry.trainable:
                    sess.bind_grad(name, None, [], "")
                sess.backward(step, grads, None, owned)
                for name, _ in entry.trainable:
                    g = sess.take_grad(name)
                    if g is not None:
                        returned[name] = torch.from_numpy(g)
        except GraftError as ex:
            raise with_context(ex, entry.module_name) from None
        finally:
            sess.release(step)
        _trace("graft_backward_end")
        if ctx.in_graph and entry.mode != "hold":
            for (name, p), t in zip(entry.trainable, targets):
                if t == "deliver":  # graft returns None for it (see _hide_hooks_from_none)
                    _hide_hooks_from_none(p, entry.acc_node(p))
        arrays = step.input_grads()
        igrads = dict(zip(entry.input_grads, wrap_outputs(arrays, ctx.tensors)))
        del arrays
        input_grads = [igrads.get(name) for name in entry.input_names]
        param_grads = [returned.get(name) for name, _ in entry.trainable] if ctx.in_graph else []
        return (None, None, None, *input_grads, *param_grads)
