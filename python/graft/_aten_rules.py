"""The aten -> graft table of GraftModule's capture (Note [capture], _aten.py): one rule per aten
op, (builder, out, *the op's arguments) -> the name(s) of the graft values it computes. Graph values
reach a rule as meta tensors (shape and dtype), constants as real tensors or numbers; `out` is the
op's result as meta tensors. A rule that cannot take its arguments raises NotCaptured."""
import torch

from ._aten import PREFIX, NotCaptured, elem

# --- the rules: (builder, out, *aten args) -> output name(s) ------------------------------------
RULES = {}
_RULES = RULES


def rule(*names):
    def reg(fn):
        for n in names:
            _RULES[n] = fn
        return fn
    return reg


def _axis(d, rank):
    return d + rank if d < 0 else d


def _reduce_axes(a, dims):
    """The axes a reduction over `dims` (an int, a list, or None / empty for all) covers."""
    if dims is None or (isinstance(dims, (list, tuple)) and not dims):
        return list(range(a.dim()))
    return [_axis(d, a.dim()) for d in (dims if isinstance(dims, (list, tuple)) else [dims])]


def _binary(onnx_op):
    def fn(r, out, a, b, alpha=1):
        dt = out.dtype
        x, y = _operands(r, out, a, b, dtype=dt)
        if alpha != 1:
            y = r.emit("Mul", [y, r.v(alpha, dt)])
        return r.emit(onnx_op, [x, y])
    return fn


for _n, _o in (("add", "Add"), ("add_", "Add"), ("sub", "Sub"), ("sub_", "Sub"), ("mul", "Mul"), ("mul_", "Mul"),
               ("minimum", "Min"), ("maximum", "Max")):
    _RULES[_n] = _binary(_o)


@rule("div", "div_")
def _div(r, out, a, b, rounding_mode=None):
    if rounding_mode is not None:
        raise NotCaptured("div with a rounding mode")
    return r.emit("Div", _operands(r, out, a, b, dtype=out.dtype))


@rule("rsub")
def _rsub(r, out, a, b, alpha=1):
    dt = out.dtype
    x = r.v(a, dt)
    if alpha != 1:
        x = r.emit("Mul", [x, r.v(alpha, dt)])
    return r.emit("Sub", [r.v(b, dt), x])


def _unary(onnx_op):
    def fn(r, out, a):
        return r.emit(onnx_op, [r.v(a)])
    return fn


for _n, _o in (("neg", "Neg"), ("tanh", "Tanh"), ("tanh_", "Tanh"), ("sigmoid", "Sigmoid"),
               ("sigmoid_", "Sigmoid"), ("relu", "Relu"), ("relu_", "Relu"), ("abs", "Abs"), ("log", "Log"),
               ("exp", "Exp"), ("sqrt", "Sqrt"), ("sin", "Sin"), ("cos", "Cos"), ("reciprocal", "Reciprocal"), ("erf", "Erf")):
    _RULES[_n] = _unary(_o)


@rule("silu", "silu_")
def _silu(r, out, a):  # x * sigmoid(x): graft's importer makes it one Silu (autodiff/rewrite.cpp)
    x = r.v(a)
    return r.emit("Mul", [x, r.emit("Sigmoid", [x])])


@rule("rsqrt")
def _rsqrt(r, out, a):
    return r.emit("Reciprocal", [r.emit("Sqrt", [r.v(a)])])


@rule("gelu", "gelu_")
def _gelu(r, out, a, approximate="none"):
    return r.emit("Gelu", [r.v(a)], attrs=[("approximate", "s", approximate)])


@rule("pow")
def _pow(r, out, a, b):
    if not isinstance(a, torch.Tensor):
        raise NotCaptured("pow of a number by a tensor")
    return r.emit("Pow", [r.v(a), r.v(b, out.dtype) if isinstance(b, torch.Tensor) else r.v(float(b), out.dtype)])


@rule("clone", "alias", "lift_fresh", "detach", "contiguous")  # detach: of integers only (above)
def _same(r, out, a, **kw):
    return r.v(a)


@rule("_to_copy")
def _to_copy(r, out, a, dtype=None, **kw):
    if dtype is None or dtype == a.dtype:
        return r.v(a)
    return r.v(a, dtype)


@rule("where")
def _where(r, out, c, a, b):
    c = r.v(c, torch.bool)
    x, y = _operands(r, out, a, b, dtype=out.dtype)
    return r.emit("Where", [c, x, y])


@rule("masked_fill", "masked_fill_")
def _masked_fill(r, out, a, mask, value):
    if mask.dtype != torch.bool:
        raise NotCaptured("masked_fill with a mask that is not bool")
    x, m = _operands(r, out, a, mask)
    return r.emit("Where", [m, r.v(value, out.dtype), x])


def _compare(onnx_op, negate=False):
    def fn(r, out, a, b):
        dt = torch.result_type(a, b)
        y = r.emit(onnx_op, [r.v(a, dt), r.v(b, dt)])
        return r.emit("Not", [y]) if negate else y
    return fn


for _n, _o, _neg in (("eq", "Equal", False), ("ne", "Equal", True), ("lt", "Less", False),
                     ("le", "LessOrEqual", False), ("gt", "Greater", False), ("ge", "GreaterOrEqual", False)):
    _RULES[_n] = _compare(_o, _neg)


# shapes
@rule("view", "_unsafe_view", "_reshape_alias", "reshape", "flatten")
def _reshape(r, out, a, *rest, **kw):
    return r.emit("Reshape", [r.v(a), r.ints(out.shape)])


@rule("t", "transpose", "transpose_")
def _transpose(r, out, a, d0=0, d1=1):
    rank = a.dim()
    if rank < 2:
        return r.v(a)
    perm = list(range(rank))
    d0, d1 = _axis(d0, rank), _axis(d1, rank)
    perm[d0], perm[d1] = perm[d1], perm[d0]
    return r.emit("Transpose", [r.v(a)], attrs=[("perm", "I", perm)])


@rule("permute")
def _permute(r, out, a, dims):
    return r.emit("Transpose", [r.v(a)], attrs=[("perm", "I", [_axis(d, a.dim()) for d in dims])])


@rule("unsqueeze", "unsqueeze_")
def _unsqueeze(r, out, a, d):
    return r.emit("Unsqueeze", [r.v(a), r.ints([_axis(d, a.dim() + 1)])])


@rule("squeeze", "squeeze_")
def _squeeze(r, out, a, d=None):
    if d is None:
        axes = [i for i, s in enumerate(a.shape) if s == 1]
    else:
        ds = d if isinstance(d, (list, tuple)) else [d]
        axes = [_axis(x, a.dim()) for x in ds if a.shape[_axis(x, a.dim())] == 1]
    if not axes:
        return r.v(a)
    return r.emit("Squeeze", [r.v(a), r.ints(axes)])


@rule("expand")
def _expand(r, out, a, size, implicit=False):
    if tuple(out.shape) == tuple(a.shape):
        return r.v(a)  # a view of the same shape: the same value
    return r.emit("Expand", [r.v(a), r.ints(out.shape)])


def _operands(r, out, *xs, dtype=None):
    """The graph values of an elementwise op's operands; an operand that is an Expand (eager: a
    broadcast view, no memory) is read unexpanded where broadcasting gives the output its shape
    anyway, so that graft does not materialize (and keep) the expanded copy."""
    names = [r.v(x, dtype) for x in xs]
    shapes = [list(x.shape) if isinstance(x, torch.Tensor) else [] for x in xs]
    for i, n in enumerate(names):
        prod = r.producer.get(n)
        if prod is None or prod[0] != "Expand":
            continue
        src = r.shapes.get(prod[1][0])
        if src is None:
            continue
        trial = shapes[:i] + [src] + shapes[i + 1:]
        try:
            if list(torch.broadcast_shapes(*[torch.Size(t) for t in trial])) == list(out.shape):
                names[i], shapes[i] = prod[1][0], src
        except RuntimeError:
            pass
    return names


@rule("slice")
def _slice(r, out, a, dim=0, start=None, end=None, step=1):
    dim = _axis(dim, a.dim())
    n = a.shape[dim]
    start = 0 if start is None else start
    end = n if end is None else end
    start = max(0, min(n, start + n if start < 0 else start))
    end = max(0, min(n, end + n if end < 0 else end))
    if start == 0 and end == n and step == 1:
        return r.v(a)
    return r.emit("Slice", [r.v(a), r.ints([start]), r.ints([end]), r.ints([dim]), r.ints([step])])


@rule("select")
def _select(r, out, a, dim, index):
    dim = _axis(dim, a.dim())
    index = index + a.shape[dim] if index < 0 else index
    return r.emit("Gather", [r.v(a), r.v(torch.tensor(index, dtype=torch.int64))], attrs=[("axis", "i", dim)])


@rule("unbind")
def _unbind(r, out, a, dim=0):
    return [_select(r, None, a, dim, i) for i in range(a.shape[_axis(dim, a.dim())])]


@rule("split", "unsafe_split", "split_with_sizes", "unsafe_split_with_sizes")
def _split(r, out, a, sizes, dim=0):
    dim = _axis(dim, a.dim())
    sizes = [o.shape[dim] for o in out]
    return r.emit("Split", [r.v(a), r.ints(sizes)], attrs=[("axis", "i", dim)], nout=len(sizes))


@rule("cat")
def _cat(r, out, ts, dim=0):
    ts = [t for t in ts if not (t.dim() == 1 and t.shape[0] == 0)]
    return r.emit("Concat", [r.v(t, out.dtype) for t in ts], attrs=[("axis", "i", _axis(dim, out.dim()))])


@rule("stack")
def _stack(r, out, ts, dim=0):
    d = _axis(dim, out.dim())
    parts = [r.emit("Unsqueeze", [r.v(t, out.dtype), r.ints([d])]) for t in ts]
    return r.emit("Concat", parts, attrs=[("axis", "i", d)])


@rule("repeat")
def _repeat(r, out, a, reps):
    x = r.v(a)
    extra = len(reps) - a.dim()
    if extra > 0:
        x = r.emit("Reshape", [x, r.ints([1] * extra + list(a.shape))])
    return r.emit("Tile", [x, r.ints(reps)])


def _trilu_rule(upper):
    def fn(r, out, a, diagonal=0):
        return r.emit("Trilu", [r.v(a), r.v(torch.tensor(diagonal, dtype=torch.int64))],
                      attrs=[("upper", "i", upper)])
    return fn


_RULES["triu"], _RULES["tril"] = _trilu_rule(1), _trilu_rule(0)


# linear algebra
@rule("mm", "bmm", "matmul", "mv", "dot", "vdot")  # 1-D operands as numpy (vdot: real here)
def _mm(r, out, a, b):
    return r.emit("MatMul", [r.v(a), r.v(b)])


@rule("addmm")
def _addmm(r, out, bias, a, b, beta=1, alpha=1):
    attrs = [("alpha", "f", float(alpha)), ("beta", "f", float(beta))]
    bn = r.v(b)
    prod = r.producer.get(bn)
    if prod is not None and prod[0] == "Transpose" and b.dim() == 2:  # x @ W.t(): Gemm(transB)
        attrs.append(("transB", "i", 1))
        bn = prod[1][0]
    return r.emit("Gemm", [r.v(a), bn, r.v(bias)], attrs=attrs)


@rule("baddbmm")
def _baddbmm(r, out, c, a, b, beta=1, alpha=1):
    y = r.emit("MatMul", [r.v(a), r.v(b)])
    if alpha != 1:
        y = r.emit("Mul", [y, r.v(float(alpha), out.dtype)])
    if beta == 0:
        return y
    cc = r.v(c)
    if beta != 1:
        cc = r.emit("Mul", [cc, r.v(float(beta), out.dtype)])
    return r.emit("Add", [y, cc])


# reductions
@rule("mean")
def _mean(r, out, a, dims=None, keepdim=False, dtype=None):
    if dtype is not None:
        raise NotCaptured("mean with a dtype")
    axes = _reduce_axes(a, dims)
    return r.emit("ReduceMean", [r.v(a)], attrs=[("axes", "I", axes), ("keepdims", "i", int(keepdim))])


@rule("sum")
def _sum(r, out, a, dims=None, keepdim=False, dtype=None):
    if dtype is not None and dtype != a.dtype:
        raise NotCaptured("sum with a dtype")
    if not a.is_floating_point() and not out.is_floating_point():
        # a count (torch 2.x's cross_entropy sums a bool mask): graft's ReduceSum takes floats, so
        # in float64 (exact below 2**53), cast back to PyTorch's integer result
        s = r.emit("ReduceSum", [r.v(a, torch.float64), r.ints(_reduce_axes(a, dims))],
                   attrs=[("keepdims", "i", int(keepdim))])
        return r.emit("Cast", [s], attrs=[("to", "i", elem(out.dtype))])
    return r.emit("ReduceSum", [r.v(a), r.ints(_reduce_axes(a, dims))], attrs=[("keepdims", "i", int(keepdim))])


def _p_norm(r, x, axes, p, keepdim=False):
    """The p-norm of graph value x over `axes`, p = 2 (ReduceL2; its gradient 0 where the norm is,
    as PyTorch's norm, cdist and pdist backward) or 1."""
    if p == 2:
        return r.emit("ReduceL2", [x], attrs=[("axes", "I", list(axes)), ("keepdims", "i", int(keepdim))])
    if p == 1:
        return r.emit("ReduceSum", [r.emit("Abs", [x]), r.ints(axes)], attrs=[("keepdims", "i", int(keepdim))])
    raise NotCaptured(f"a norm of order {p} (graft has the 1- and 2-norms)")


@rule("norm", "linalg_vector_norm")
def _norm(r, out, a, p=2, dim=None, keepdim=False, dtype=None):
    """The 2-norm and the 1-norm over `dim` or all axes (torch.norm, F.normalize, spectral_norm's
    power iteration)."""
    p = 2 if p is None else p
    if dtype is not None and dtype != a.dtype:
        raise NotCaptured("a norm with a dtype")
    return _p_norm(r, r.v(a), _reduce_axes(a, dim), p, keepdim)


@rule("_weight_norm_interface")
def _weight_norm(r, out, v, g, dim=0):
    """weight_norm's w = v * g / |v| (the norm over every axis but `dim`, kept); returns (w, |v|)."""
    axes = [d for d in range(v.dim()) if d != _axis(dim, v.dim())]
    norm = r.emit("ReduceL2", [r.v(v)], attrs=[("axes", "I", axes), ("keepdims", "i", 1)])
    return [r.emit("Mul", [r.v(v), r.emit("Div", [r.v(g), norm])]), norm]


@rule("amax")
def _amax(r, out, a, dims=(), keepdim=False):
    axes = _reduce_axes(a, dims)
    return r.emit("ReduceMax", [r.v(a)], attrs=[("axes", "I", axes), ("keepdims", "i", int(keepdim))])


def _extreme(reduce_op, arg_op):
    def fn(r, out, a, dim=None, keepdim=False):
        if dim is None or isinstance(dim, torch.Tensor):  # max(a): the whole tensor; max(a, b): elementwise
            if isinstance(dim, torch.Tensor):
                return r.emit("Max" if reduce_op == "ReduceMax" else "Min", _operands(r, out, a, dim, dtype=out.dtype))
            return r.emit(reduce_op, [r.emit("Reshape", [r.v(a), r.ints([-1])])],
                          attrs=[("axes", "I", [0]), ("keepdims", "i", 0)])
        d = _axis(dim, a.dim())
        x = r.v(a)
        vals = r.emit(reduce_op, [x], attrs=[("axes", "I", [d]), ("keepdims", "i", int(keepdim))])
        idx = r.emit(arg_op, [x], attrs=[("axis", "i", d), ("keepdims", "i", int(keepdim))])
        return [vals, idx]
    return fn


_RULES["max"], _RULES["min"] = _extreme("ReduceMax", "ArgMax"), _extreme("ReduceMin", "ArgMin")


def _arg_rule(onnx_op):
    def fn(r, out, a, dim=None, keepdim=False):
        x = r.v(a)
        if dim is None:
            return r.emit(onnx_op, [r.emit("Reshape", [x, r.ints([-1])])], attrs=[("axis", "i", 0), ("keepdims", "i", 0)])
        return r.emit(onnx_op, [x], attrs=[("axis", "i", _axis(dim, a.dim())), ("keepdims", "i", int(keepdim))])
    return fn


_RULES["argmax"], _RULES["argmin"] = _arg_rule("ArgMax"), _arg_rule("ArgMin")


@rule("cumsum")
def _cumsum(r, out, a, dim, dtype=None):
    x = r.v(a, out.dtype)
    return r.emit("CumSum", [x, r.v(torch.tensor(_axis(dim, a.dim()), dtype=torch.int64))])


# nn
@rule("_softmax")
def _softmax(r, out, a, dim, half_to_float=False):
    return r.emit("Softmax", [r.v(a)], attrs=[("axis", "i", _axis(dim, a.dim()))])


@rule("_log_softmax")
def _log_softmax(r, out, a, dim, half_to_float=False):
    return r.emit("LogSoftmax", [r.v(a)], attrs=[("axis", "i", _axis(dim, a.dim()))])


@rule("native_layer_norm")
def _layer_norm(r, out, x, shape, w, b, eps):
    dt = x.dtype
    wn = r.v(w) if w is not None else r.v(torch.ones(tuple(shape), dtype=dt))
    bn = r.v(b) if b is not None else r.v(torch.zeros(tuple(shape), dtype=dt))
    y = r.emit("LayerNormalization", [r.v(x), wn, bn],
               attrs=[("axis", "i", x.dim() - len(shape)), ("epsilon", "f", float(eps))])
    return [y, None, None]


@rule("embedding")
def _embedding(r, out, w, idx, padding_idx=-1, scale_grad_by_freq=False, sparse=False):
    if scale_grad_by_freq or sparse:
        raise NotCaptured("embedding with scale_grad_by_freq or sparse")
    attrs = [("axis", "i", 0)]
    if padding_idx is not None and padding_idx >= 0:
        attrs.append(("padding_idx", "i", int(padding_idx)))
    return r.emit("Gather", [r.v(w), r.v(idx)], attrs=attrs)


@rule("index")
def _index(r, out, a, indices):
    """x[i0, i1, ...] with integer index tensors on consecutive axes (None elsewhere): one Gather
    for a single index, else a GatherND over the indices broadcast together, the indexed axes
    moved first and the result's axes put where PyTorch puts them."""
    at = [k for k, ix in enumerate(indices) if ix is not None]
    if not at or at != list(range(at[0], at[-1] + 1)) or \
            any(indices[k].dtype not in (torch.int64, torch.int32) for k in at):
        raise NotCaptured("advanced indexing other than integer index tensors on consecutive axes")
    p, k = at[0], len(at)
    if k == 1:
        return r.emit("Gather", [r.v(a), r.v(indices[p], torch.int64)], attrs=[("axis", "i", p)])
    shape = list(torch.broadcast_shapes(*[indices[j].shape for j in at]))
    parts = [r.emit("Unsqueeze", [r.emit("Expand", [r.v(indices[j], torch.int64), r.ints(shape)]), r.ints([-1])])
             for j in at]
    idx = r.emit("Concat", parts, attrs=[("axis", "i", -1)])
    x = r.v(a)
    rank = a.dim()
    if p:
        x = r.emit("Transpose", [x], attrs=[("perm", "I", list(range(p, p + k)) + list(range(p))
                                             + list(range(p + k, rank)))])
    y = r.emit("GatherND", [x, idx])
    if p:
        s = len(shape)
        total = s + rank - k
        y = r.emit("Transpose", [y], attrs=[("perm", "I", list(range(s, s + p)) + list(range(s))
                                             + list(range(s + p, total)))])
    return y


@rule("convolution")
def _convolution(r, out, x, w, b, stride, padding, dilation, transposed, output_padding, groups):
    ins = [r.v(x), r.v(w)] + ([r.v(b)] if b is not None else [])
    k = w.dim() - 2
    attrs = [("strides", "I", list(stride)), ("pads", "I", list(padding) * 2), ("dilations", "I", list(dilation)),
             ("group", "i", int(groups)), ("kernel_shape", "I", list(w.shape[2:2 + k]))]
    if transposed:  # weight [C_in, C_out / groups, k...], as ONNX's ConvTranspose
        return r.emit("ConvTranspose", ins, attrs=attrs + [("output_padding", "I", list(output_padding))])
    return r.emit("Conv", ins, attrs=attrs)


@rule("nll_loss_forward")
def _nll_loss(r, out, logp, target, weight, reduction, ignore_index):
    name = r.v(logp)
    prod = r.producer.get(name)
    if prod is None or prod[0] != "LogSoftmax" or dict((a[0], a[2]) for a in prod[2]).get("axis") != 1:
        raise NotCaptured("nll_loss of something other than log_softmax over axis 1")
    red = {0: "none", 1: "mean", 2: "sum"}[reduction]
    weights = [] if weight is None else [r.v(weight, logp.dtype)]  # as PyTorch: mean over the labels' weights
    loss = r.emit("SoftmaxCrossEntropyLoss", [prod[1][0], r.v(target)] + weights,
                  attrs=[("reduction", "s", red), ("ignore_index", "i", int(ignore_index))])
    return [loss]  # total_weight (output 1) is not captured: reading it is refused


# --- nn.LSTM / nn.GRU, captured whole ----------------------------------------------------------
# Below autograd PyTorch runs an RNN as its cell's ops, step by step; graft has fused LSTM and GRU
# ops (their ONNX definitions) whose backward keeps only what eager's keeps per step. So an
# nn.LSTM / nn.GRU is captured as one ONNX LSTM / GRU node per layer, as torch.onnx.export writes
# it: the gate blocks reordered (PyTorch i f g o -> ONNX i o f c; r z n -> z r h), the biases
# concatenated, GRU with linear_before_reset (PyTorch's formula). The module's own forward computes
# the values, unrecorded.
_GATES = {"LSTM": (0, 3, 1, 2), "GRU": (1, 0, 2)}  # ONNX's gate order, as indices of PyTorch's blocks




# --- what functionalization writes instead of in-place ops and writes through views --------------
def _filled(r, value, out):
    """A value of out's shape and dtype, every element `value` (a number)."""
    return r.emit("Expand", [r.v(value, out.dtype), r.ints(out.shape)])


@rule("zeros_like", "empty_like", "new_zeros", "new_empty", "empty_strided", "new_empty_strided")
def _zeros_like(r, out, *a, **kw):
    return _filled(r, False if out.dtype == torch.bool else 0, out)


@rule("ones_like", "new_ones")
def _ones_like(r, out, *a, **kw):
    return _filled(r, True if out.dtype == torch.bool else 1, out)


@rule("full_like")
def _full_like(r, out, a, value, **kw):
    return _filled(r, value, out)


@rule("new_full")
def _new_full(r, out, a, size, value, **kw):
    return _filled(r, value, out)


@rule("fill")
def _fill(r, out, a, value):
    if isinstance(value, torch.Tensor):
        return r.emit("Expand", [r.v(value, out.dtype), r.ints(out.shape)])
    return _filled(r, value, out)


@rule("copy")
def _copy(r, out, dst, src, non_blocking=False):
    x = r.v(src, out.dtype)
    if tuple(src.shape) != tuple(out.shape):
        x = r.emit("Expand", [x, r.ints(out.shape)])
    return x


def _block(r, base, value, d, start, end):
    """base with its block [start, end) along axis d replaced by value (already the block's shape)."""
    parts = []
    bname = r.v(base)
    n = base.shape[d]
    if start > 0:
        parts.append(r.emit("Slice", [bname, r.ints([0]), r.ints([start]), r.ints([d]), r.ints([1])]))
    parts.append(value)
    if end < n:
        parts.append(r.emit("Slice", [bname, r.ints([end]), r.ints([n]), r.ints([d]), r.ints([1])]))
    return r.emit("Concat", parts, attrs=[("axis", "i", d)]) if len(parts) > 1 else parts[0]


@rule("slice_scatter")
def _slice_scatter(r, out, base, src, dim=0, start=None, end=None, step=1):
    dim = _axis(dim, base.dim())
    n = base.shape[dim]
    start = 0 if start is None else start
    end = n if end is None else end
    start = max(0, min(n, start + n if start < 0 else start))
    end = max(start, min(n, end + n if end < 0 else end))
    if step != 1:
        raise NotCaptured("a write into a strided slice")
    return _block(r, base, r.v(src, out.dtype), dim, start, end)


@rule("select_scatter")
def _select_scatter(r, out, base, src, dim, index):
    dim = _axis(dim, base.dim())
    index = index + base.shape[dim] if index < 0 else index
    value = r.emit("Unsqueeze", [r.v(src, out.dtype), r.ints([dim])])
    return _block(r, base, value, dim, index, index + 1)


# --- training-mode layers -------------------------------------------------------------------------
def _batch_norm(r, out, x, w, b, mean, var, training, momentum, eps, functional):
    c = x.shape[1]
    dt = x.dtype
    wn = r.v(w) if w is not None else r.v(torch.ones(c, dtype=dt))
    bn = r.v(b) if b is not None else r.v(torch.zeros(c, dtype=dt))
    if not training:
        if mean is None:
            raise NotCaptured("batch_norm in eval mode without running statistics")
        y = r.emit("BatchNormalization", [r.v(x), wn, bn, r.v(mean), r.v(var)], attrs=[("epsilon", "f", float(eps))])
        return [y] + [None] * (len(out) - 1)
    have = mean is not None
    mn = r.v(mean) if have else r.v(torch.zeros(c, dtype=dt))
    vn = r.v(var) if have else r.v(torch.ones(c, dtype=dt))
    y, new_mean, new_var = r.emit("BatchNormalization", [r.v(x), wn, bn, mn, vn], nout=3,
                                  attrs=[("epsilon", "f", float(eps)), ("momentum", "f", 1.0 - float(momentum)),
                                         ("training_mode", "i", 1)])
    if functional:  # torch 2.x: (out, save_mean, save_rstd, new running mean, new running var)
        return [y, None, None, new_mean if have else None, new_var if have else None]
    if have:  # torch 1.13 writes the statistics in place without saying so: the update is graft's to make
        for t, new in ((mean, new_mean), (var, new_var)):
            name = r.name_of(t)
            if name is None or not name.startswith(PREFIX):
                raise NotCaptured("batch_norm statistics that are not the module's buffers")
            r.updates[name] = new
    return [y, None, None]


@rule("native_batch_norm")
def _native_batch_norm(r, out, x, w, b, mean, var, training, momentum, eps):
    return _batch_norm(r, out, x, w, b, mean, var, training, momentum, eps, functional=False)


@rule("_native_batch_norm_legit_functional")
def _native_batch_norm_functional(r, out, x, w, b, mean, var, training, momentum, eps):
    return _batch_norm(r, out, x, w, b, mean, var, training, momentum, eps, functional=True)


@rule("_native_batch_norm_legit_no_training")
def _native_batch_norm_eval(r, out, x, w, b, mean, var, momentum, eps):
    return _batch_norm(r, out, x, w, b, mean, var, False, momentum, eps, functional=False)


@rule("_native_batch_norm_legit")
def _native_batch_norm_legit(r, out, x, w, b, *rest):
    if len(rest) == 3:  # (training, momentum, eps): no running statistics
        return _batch_norm(r, out, x, w, b, None, None, rest[0], rest[1], rest[2], functional=False)
    return _batch_norm(r, out, x, w, b, *rest, functional=False)


@rule("native_dropout")
def _native_dropout(r, out, x, p, train):
    if not train or p == 0:
        return [r.v(x), None]
    r.has_dropout = True
    y = r.emit("Dropout", [r.v(x), r.v(float(p), out[0].dtype), r.v(True)])
    return [y, None]


# --- logic and clamps ----------------------------------------------------------------------------
def _bool(r, x):
    return r.v(x, torch.bool) if isinstance(x, torch.Tensor) else r.v(bool(x))


@rule("logical_not")
def _logical_not(r, out, a):
    return r.emit("Not", [_bool(r, a)])


@rule("bitwise_not")
def _bitwise_not(r, out, a):
    if a.dtype != torch.bool:
        raise NotCaptured("bitwise_not of an integer tensor")
    return r.emit("Not", [r.v(a)])


def _logic(onnx_op, bitwise):
    def fn(r, out, a, b):
        if bitwise and (out.dtype != torch.bool):
            raise NotCaptured("a bitwise op on integers")
        return r.emit(onnx_op, [_bool(r, a), _bool(r, b)])
    return fn


for _n, _o in (("and", "And"), ("or", "Or"), ("xor", "Xor")):
    _RULES[f"logical_{_n}"] = _logic(_o, False)
    _RULES[f"bitwise_{_n}"] = _logic(_o, True)


def _any_of(r, a, dim, keepdim):
    """Whether any element along dim (all where None) is true, as bool."""
    x = r.emit("Cast", [_bool(r, a)], attrs=[("to", "i", 1)])
    axes = _reduce_axes(a, dim)
    m = r.emit("ReduceMax", [x], attrs=[("axes", "I", axes), ("keepdims", "i", int(keepdim))])
    return r.emit("Greater", [m, r.v(0.0)])


@rule("any")
def _any(r, out, a, dim=None, keepdim=False):
    return _any_of(r, a, dim, keepdim)


@rule("all")
def _all(r, out, a, dim=None, keepdim=False):
    neg = r.emit("Not", [_bool(r, a)])
    x = r.emit("Cast", [neg], attrs=[("to", "i", 1)])
    axes = _reduce_axes(a, dim)
    m = r.emit("ReduceMax", [x], attrs=[("axes", "I", axes), ("keepdims", "i", int(keepdim))])
    return r.emit("Not", [r.emit("Greater", [m, r.v(0.0)])])


@rule("clamp", "clamp_min", "clamp_max", "hardtanh")
def _clamp(r, out, a, lo=None, hi=None):
    if isinstance(lo, torch.Tensor) or isinstance(hi, torch.Tensor):
        raise NotCaptured("clamp with tensor bounds")
    return r.emit("Clip", [r.v(a), r.v(float(lo), out.dtype) if lo is not None else "",
                           r.v(float(hi), out.dtype) if hi is not None else ""])


_RULES["clamp_max"] = lambda r, out, a, hi: _clamp(r, out, a, None, hi)


@rule("leaky_relu")
def _leaky_relu(r, out, a, slope=0.01):
    x = r.v(a)
    return r.emit("Where", [r.emit("Greater", [x, r.v(0.0, a.dtype)]), x, r.emit("Mul", [x, r.v(float(slope), a.dtype)])])


@rule("sign")
def _sign(r, out, a):
    return r.emit("Sign", [r.v(a)])


@rule("index_select")
def _index_select(r, out, a, dim, index):
    return r.emit("Gather", [r.v(a), r.v(index)], attrs=[("axis", "i", _axis(dim, a.dim()))])


@rule("hardsigmoid")
def _hardsigmoid(r, out, a):
    return r.emit("HardSigmoid", [r.v(a)], attrs=[("alpha", "f", 1.0 / 6), ("beta", "f", 0.5)])


@rule("hardswish")
def _hardswish(r, out, a):
    return r.emit("HardSwish", [r.v(a)])


@rule("bernoulli", "bernoulli_")
def _bernoulli(r, out, a, p=None, generator=None):
    """bernoulli(x, p): 0 / 1 draws of probability p in x's shape (how dropout is written below
    autograd), from graft's Dropout of ones: Bernoulli(1 - ratio) / (1 - ratio), times p."""
    if p is None or isinstance(p, torch.Tensor) or generator is not None:
        raise NotCaptured("bernoulli with per-element probabilities or a generator")
    p = float(p)
    if not 0 < p < 1:
        return _filled(r, 1.0 if p >= 1 else 0.0, out)
    r.has_dropout = True
    ones = _filled(r, 1.0, out)
    kept = r.emit("Dropout", [ones, r.v(1.0 - p, out.dtype), r.v(True)])
    return r.emit("Mul", [kept, r.v(p, out.dtype)])


# --- pooling -----------------------------------------------------------------------------------
def _pool_attrs(k, kernel, stride, padding, ceil_mode, dilation=None):
    kernel = list(kernel) * (k // len(kernel)) if len(kernel) < k else list(kernel)
    stride = list(stride) if stride else kernel
    stride = stride * (k // len(stride)) if len(stride) < k else stride
    padding = list(padding) * (k // len(padding)) if len(padding) < k else list(padding)
    attrs = [("kernel_shape", "I", kernel), ("strides", "I", stride), ("pads", "I", padding * 2),
             ("ceil_mode", "i", int(ceil_mode))]
    if dilation is not None:
        dilation = list(dilation) * (k // len(dilation)) if len(dilation) < k else list(dilation)
        attrs.append(("dilations", "I", dilation))
    return attrs


@rule("max_pool2d_with_indices", "max_pool1d_with_indices", "max_pool3d_with_indices")
def _max_pool(r, out, x, kernel, stride=(), padding=(0,), dilation=(1,), ceil_mode=False):
    k = x.dim() - 2
    y = r.emit("MaxPool", [r.v(x)], attrs=_pool_attrs(k, kernel, stride, padding, ceil_mode, dilation))
    return [y, None]  # the indices are not captured: reading them is refused (no name)


@rule("avg_pool2d", "avg_pool1d", "avg_pool3d")
def _avg_pool(r, out, x, kernel, stride=(), padding=(0,), ceil_mode=False, count_include_pad=True,
              divisor_override=None):
    if divisor_override is not None:
        raise NotCaptured("avg_pool with divisor_override")
    k = x.dim() - 2
    return r.emit("AveragePool", [r.v(x)], attrs=_pool_attrs(k, kernel, stride, padding, ceil_mode)
                  + [("count_include_pad", "i", int(count_include_pad))])


@rule("as_strided")
def _as_strided(r, out, a, size, stride, storage_offset=None):
    """Only the as_strided that is a reshape of a contiguous value (functionalization writes one for
    a view whose size-1 dimensions have other strides, as ConvNeXt's LayerNorm over a 1x1 map)."""
    size, stride = list(size), list(stride)
    want, acc = [0] * len(size), 1
    for i in reversed(range(len(size))):
        want[i] = acc
        acc *= size[i]
    if storage_offset or not a.is_contiguous() or acc != a.numel() or any(s != w for s, w, n in zip(stride, want, size) if n != 1):
        raise NotCaptured("an as_strided view other than a reshape")
    if tuple(size) == tuple(a.shape):
        return r.v(a)
    return r.emit("Reshape", [r.v(a), r.ints(size)])


from . import _aten_layers  # noqa: E402,F401  (more rules)
