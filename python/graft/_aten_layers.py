"""More rules of the aten -> graft table (_aten_rules.py): torch.nn layers that have no graft op of
their own, each composed of graft ops. Imported at the end of _aten_rules.py.

Where a formula is piecewise (ELU, Softplus), the branch not taken is computed so that it cannot
overflow: graft's Where sends a zero gradient into that branch, and 0 * inf (the gradient of exp at
a large x) would be NaN.
"""
import torch

from ._aten import _INTERPOLATE, NotCaptured, elem, takes_align_corners
from ._aten_rules import RULES, _axis, _operands, _p_norm, _reduce_axes, rule

_leaky_relu = RULES["leaky_relu"]


def _where_pos(r, x, dt, neg, threshold=0.0):
    """x > threshold ? x : neg (x a graph value name)."""
    return r.emit("Where", [r.emit("Greater", [x, r.v(float(threshold), dt)]), x, neg])


def _softplus(r, z, dt):
    """log(1 + exp(z)), stably: max(z, 0) + log(1 + exp(-|z|)) (exp never overflows; its gradient
    is sigmoid(z), as PyTorch's)."""
    tail = r.emit("Log", [r.emit("Add", [r.v(1.0, dt), r.emit("Exp", [r.emit("Neg", [r.emit("Abs", [z])])])])])
    return r.emit("Add", [r.emit("Relu", [z]), tail])


def _channel_vector(r, w, rank):
    """A per-channel parameter [C] shaped [C, 1, ...] to broadcast over axis 1 of a rank-`rank` value."""
    return r.emit("Reshape", [r.v(w), r.ints([w.numel()] + [1] * (rank - 2))])


# --- activations ---------------------------------------------------------------------------------
@rule("rrelu_with_noise", "rrelu_with_noise_functional")
def _rrelu(r, out, a, noise, lower=1.0 / 8, upper=1.0 / 3, training=False, generator=None):
    if training:  # graft's RRelu: the slopes drawn from graft's stream (as Dropout's masks)
        if not a.is_floating_point():
            raise NotCaptured("rrelu of integers")
        r.has_dropout = True  # (a seed per call, as for Dropout)
        y, _ = r.emit("RRelu", [r.v(a)], attrs=[("lower", "f", float(lower)), ("upper", "f", float(upper))],
                      nout=2, domain="graft")
    else:
        y = _leaky_relu(r, out, a, (lower + upper) / 2)  # eval: the mean slope
    return [y, None] if isinstance(out, (tuple, list)) else y  # 2.x's functional form also gives the noise


@rule("elu", "elu_")
def _elu(r, out, a, alpha=1.0, scale=1.0, input_scale=1.0):
    """x > 0 ? scale * x : scale * alpha * (exp(input_scale * x) - 1)."""
    dt, x = a.dtype, r.v(a)
    neg = r.emit("Exp", [r.emit("Mul", [r.emit("Min", [x, r.v(0.0, dt)]), r.v(float(input_scale), dt)])])
    neg = r.emit("Mul", [r.emit("Sub", [neg, r.v(1.0, dt)]), r.v(float(alpha * scale), dt)])
    pos = x if scale == 1 else r.emit("Mul", [x, r.v(float(scale), dt)])
    return r.emit("Where", [r.emit("Greater", [x, r.v(0.0, dt)]), pos, neg])


@rule("celu", "celu_")
def _celu(r, out, a, alpha=1.0):
    return _elu(r, out, a, alpha, 1.0, 1.0 / alpha)


@rule("selu", "selu_")
def _selu(r, out, a):
    return _elu(r, out, a, 1.6732632423543772848170429916717, 1.0507009873554804934193349852946)


@rule("softplus")
def _softplus_rule(r, out, a, beta=1.0, threshold=20.0):
    """x * beta > threshold ? x : softplus(beta * x) / beta."""
    dt, x = a.dtype, r.v(a)
    z = x if beta == 1 else r.emit("Mul", [x, r.v(float(beta), dt)])
    y = _softplus(r, z, dt)
    if beta != 1:
        y = r.emit("Div", [y, r.v(float(beta), dt)])
    return r.emit("Where", [r.emit("Greater", [z, r.v(float(threshold), dt)]), x, y])


@rule("mish", "mish_")
def _mish(r, out, a):  # x * tanh(softplus(x))
    x = r.v(a)
    return r.emit("Mul", [x, r.emit("Tanh", [_softplus(r, x, a.dtype)])])


@rule("_prelu_kernel")
def _prelu_kernel(r, out, a, w):  # torch 2.x: w already shaped to broadcast
    x = r.v(a)
    return _where_pos(r, x, a.dtype, r.emit("Mul", [x, r.v(w)]))


@rule("prelu")
def _prelu(r, out, a, w):  # torch 1.13: w is [C] (a slope per channel, axis 1) or [1]
    x = r.v(a)
    wn = _channel_vector(r, w, a.dim()) if w.numel() > 1 and a.dim() > 2 else r.v(w)
    return _where_pos(r, x, a.dtype, r.emit("Mul", [x, wn]))


@rule("threshold", "threshold_")
def _threshold(r, out, a, threshold, value):  # x > threshold ? x : value
    return _where_pos(r, r.v(a), a.dtype, r.v(float(value), a.dtype), threshold)


# --- normalization -------------------------------------------------------------------------------
@rule("native_group_norm")
def _group_norm(r, out, x, w, b, n, c, hw, groups, eps):
    """graft's LayerNormalization over each group ([N, G, C/G * HxW], its last axis), then the
    per-channel affine."""
    dt, size = x.dtype, (c // groups) * hw
    y = r.emit("Reshape", [r.v(x), r.ints([n, groups, size])])
    y = r.emit("LayerNormalization", [y, r.v(torch.ones(size, dtype=dt)), r.v(torch.zeros(size, dtype=dt))],
               attrs=[("axis", "i", 2), ("epsilon", "f", float(eps))])
    y = r.emit("Reshape", [y, r.ints(x.shape)])
    if w is not None:
        y = r.emit("Mul", [y, _channel_vector(r, w, x.dim())])
    if b is not None:
        y = r.emit("Add", [y, _channel_vector(r, b, x.dim())])
    return [y, None, None]


# --- pixel shuffles and padding ------------------------------------------------------------------
def _shuffle(r, out, a, split, perm):
    """Reshape the last three axes to `split`, permute them by `perm`, reshape to out's shape."""
    lead = list(a.shape[:-3])
    k = len(lead)
    y = r.emit("Reshape", [r.v(a), r.ints(lead + split)])
    y = r.emit("Transpose", [y], attrs=[("perm", "I", list(range(k)) + [k + p for p in perm])])
    return r.emit("Reshape", [y, r.ints(out.shape)])


@rule("pixel_shuffle")
def _pixel_shuffle(r, out, a, f):  # [C*f*f, H, W] -> [C, f, f, H, W] -> [C, H, f, W, f] -> [C, H*f, W*f]
    c, h, w = a.shape[-3:]
    return _shuffle(r, out, a, [c // (f * f), f, f, h, w], [0, 3, 1, 4, 2])


@rule("pixel_unshuffle")
def _pixel_unshuffle(r, out, a, f):  # [C, H*f, W*f] -> [C, H, f, W, f] -> [C, f, f, H, W] -> [C*f*f, H, W]
    c, h, w = a.shape[-3:]
    return _shuffle(r, out, a, [c, h // f, f, w // f, f], [0, 2, 4, 1, 3])


def _onnx_pads(rank, pad):
    """PyTorch's pad list (last axis first: begin, end, then the axis before...) as ONNX's
    [begin of each axis..., end of each axis...]."""
    begins, ends = [0] * rank, [0] * rank
    for i in range(len(pad) // 2):
        begins[rank - 1 - i], ends[rank - 1 - i] = int(pad[2 * i]), int(pad[2 * i + 1])
    return begins + ends


def _pad_rule(mode):
    def fn(r, out, a, pad):
        return r.emit("Pad", [r.v(a), r.ints(_onnx_pads(a.dim(), pad))], attrs=[("mode", "s", mode)])
    return fn


for _k in (1, 2, 3):
    RULES[f"reflection_pad{_k}d"] = _pad_rule("reflect")
    RULES[f"replication_pad{_k}d"] = _pad_rule("edge")


@rule("constant_pad_nd")
def _constant_pad(r, out, a, pad, value=0):
    return r.emit("Pad", [r.v(a), r.ints(_onnx_pads(a.dim(), pad)), r.v(value, a.dtype)],
                  attrs=[("mode", "s", "constant")])


# --- losses and reductions -----------------------------------------------------------------------
def _reduce_loss(r, loss, reduction):
    if reduction == 0:
        return loss
    return r.emit("ReduceMean" if reduction == 1 else "ReduceSum", [loss], attrs=[("keepdims", "i", 0)])


@rule("binary_cross_entropy_with_logits")
def _bce_with_logits(r, out, x, y, weight=None, pos_weight=None, reduction=1):
    """(1 - y) * x + (1 + (pos_weight - 1) * y) * softplus(-x), times weight (PyTorch's formula)."""
    dt = x.dtype
    xn, yn = r.v(x), r.v(y, dt)
    sp = _softplus(r, r.emit("Neg", [xn]), dt)
    if pos_weight is not None:
        lw = r.emit("Sub", [r.v(pos_weight, dt), r.v(1.0, dt)])
        sp = r.emit("Mul", [sp, r.emit("Add", [r.emit("Mul", [lw, yn]), r.v(1.0, dt)])])
    loss = r.emit("Add", [r.emit("Mul", [r.emit("Sub", [r.v(1.0, dt), yn]), xn]), sp])
    if weight is not None:
        loss = r.emit("Mul", [loss, r.v(weight, dt)])
    return _reduce_loss(r, loss, reduction)


@rule("logsumexp")
def _logsumexp(r, out, a, dims=(), keepdim=False):
    """m + log(sum(exp(x - m))), m the max along dims (0 where it is infinite, as PyTorch), outside
    the gradient (its contributions cancel: d/dx is softmax(x), PyTorch's formula)."""
    dt, x = a.dtype, r.v(a)
    axes = _reduce_axes(a, dims)
    m = r.emit("ReduceMax", [x], attrs=[("axes", "I", axes), ("keepdims", "i", 1)])
    inf = r.emit("Equal", [r.emit("Abs", [m]), r.v(float("inf"), dt)])
    m = r.emit("StopGradient", [r.emit("Where", [inf, r.v(0.0, dt), m])], domain="graft")
    s = r.emit("ReduceSum", [r.emit("Exp", [r.emit("Sub", [x, m])]), r.ints(axes)], attrs=[("keepdims", "i", 1)])
    y = r.emit("Add", [r.emit("Log", [s]), m])
    return y if keepdim else r.emit("Squeeze", [y, r.ints(axes)])


# torch 1.13's cross_entropy with label_smoothing takes the mean of a masked_select (the rows whose
# target is not ignore_index): a value whose length depends on the targets. It gets no graft value
# (a reader other than mean / sum is refused); mean and sum of it are computed on the whole tensor.
_base_mean, _base_sum = RULES["mean"], RULES["sum"]


def _selections(r):
    return r.__dict__.setdefault("masked_selects", {})


@rule("masked_select")
def _masked_select(r, out, a, mask):
    _selections(r)[id(out)] = (out, a, mask)
    return [None]


def _of_selection(r, a, mean):
    hit = _selections(r).get(id(a))
    if hit is None or hit[0] is not a:
        return None
    _, x, mask = hit
    dt = a.dtype
    shape = list(torch.broadcast_shapes(x.shape, mask.shape))
    m = r.v(mask, torch.bool)
    if list(mask.shape) != shape:
        m = r.emit("Expand", [m, r.ints(shape)])
    kept = r.emit("ReduceSum", [r.emit("Where", [m, r.v(x), r.v(0.0, dt)]), r.ints(range(len(shape)))],
                  attrs=[("keepdims", "i", 0)])
    if not mean:
        return kept
    count = r.emit("ReduceSum", [r.emit("Cast", [m], attrs=[("to", "i", elem(dt))]),
                                 r.ints(range(len(shape)))], attrs=[("keepdims", "i", 0)])
    return r.emit("Div", [kept, count])


@rule("mean")
def _mean(r, out, a, *rest, **kw):
    return _of_selection(r, a, True) or _base_mean(r, out, a, *rest, **kw)


@rule("sum")
def _sum(r, out, a, dims=None, keepdim=False, dtype=None):
    hit = _of_selection(r, a, False)
    return hit if hit is not None else _base_sum(r, out, a, dims, keepdim, dtype)


@rule("index_put", "index_put_")
def _index_put(r, out, a, indices, values, accumulate=False):
    """x[mask] = value (one bool mask over the leading axes, one value): a Where."""
    if len(indices) != 1 or indices[0] is None or indices[0].dtype != torch.bool or values.numel() != 1:
        raise NotCaptured("index_put other than of one value through one bool mask")
    mask = indices[0]
    m = r.v(mask)
    if mask.dim() < a.dim():
        m = r.emit("Unsqueeze", [m, r.ints(range(mask.dim(), a.dim()))])
    v = r.emit("Reshape", [r.v(values, a.dtype), r.ints([])])
    x = r.v(a)
    if accumulate:
        return r.emit("Add", [x, r.emit("Where", [m, v, r.v(0, a.dtype)])])
    return r.emit("Where", [m, v, x])


# --- pooling, bags, gather and scatter -----------------------------------------------------------
def _adaptive_avg(r, a, size, k):
    """Each of the last k axes in turn: where its size is a multiple of the output's, a reshape and
    a mean over each window; otherwise a product with the [in, out] matrix of PyTorch's windows
    (output o averages inputs floor(o * n / m) to ceil((o + 1) * n / m))."""
    dt, y = a.dtype, r.v(a)
    shape = list(a.shape)
    rank = len(shape)
    for i, m in enumerate(size):
        d = rank - k + i
        n = shape[d]
        if n % m == 0:
            if n != m:
                y = r.emit("Reshape", [y, r.ints(shape[:d] + [m, n // m] + shape[d + 1:])])
                y = r.emit("ReduceMean", [y], attrs=[("axes", "I", [d + 1]), ("keepdims", "i", 0)])
        else:
            mat = torch.zeros(n, m, dtype=dt)
            for o in range(m):
                lo, hi = (o * n) // m, -((-(o + 1) * n) // m)
                mat[lo:hi, o] = 1.0 / (hi - lo)
            perm = list(range(rank))
            perm[d], perm[-1] = perm[-1], perm[d]
            if d != rank - 1:
                y = r.emit("Transpose", [y], attrs=[("perm", "I", perm)])
            y = r.emit("MatMul", [y, r.v(mat)])
            if d != rank - 1:
                y = r.emit("Transpose", [y], attrs=[("perm", "I", perm)])
        shape[d] = m
    return y


@rule("_adaptive_avg_pool2d")
def _adaptive_avg_pool2d(r, out, a, size):
    return _adaptive_avg(r, a, list(out.shape[-2:]), 2)


@rule("_adaptive_avg_pool3d")
def _adaptive_avg_pool3d(r, out, a, size):
    return _adaptive_avg(r, a, list(out.shape[-3:]), 3)


@rule("_embedding_bag")
def _embedding_bag(r, out, w, idx, offsets, scale_grad_by_freq=False, mode=0, sparse=False,
                   per_sample_weights=None, include_last_offset=False, padding_idx=-1):
    """out = M @ weight[indices], M [bags, indices] the bags' membership (offsets[b] <= j < the next
    offset), without padding_idx, times per_sample_weights (sum), each row over its count (mean; an
    empty bag gives zeros). M is built from the offsets in the graph: they may be a call tensor.
    Its size is bags x indices."""
    if mode not in (0, 1) or scale_grad_by_freq or sparse:
        raise NotCaptured("EmbeddingBag with mode='max', scale_grad_by_freq or sparse")
    dt, n = w.dtype, idx.shape[0]
    bags = out[0].shape[0]
    offs, ids = r.v(offsets, torch.int64), r.v(idx, torch.int64)
    starts = r.emit("Slice", [offs, r.ints([0]), r.ints([bags]), r.ints([0]), r.ints([1])])
    if include_last_offset:
        ends = r.emit("Slice", [offs, r.ints([1]), r.ints([bags + 1]), r.ints([0]), r.ints([1])])
    else:
        rest = [r.emit("Slice", [offs, r.ints([1]), r.ints([bags]), r.ints([0]), r.ints([1])])] if bags > 1 else []
        ends = r.emit("Concat", rest + [r.ints([n])], attrs=[("axis", "i", 0)])
    j = r.v(torch.arange(n).view(1, n))
    member = r.emit("And", [r.emit("LessOrEqual", [r.emit("Unsqueeze", [starts, r.ints([1])]), j]),
                            r.emit("Less", [j, r.emit("Unsqueeze", [ends, r.ints([1])])])])
    if padding_idx is not None and padding_idx >= 0:
        pad = r.emit("Equal", [ids, r.v(int(padding_idx))])
        member = r.emit("And", [member, r.emit("Unsqueeze", [r.emit("Not", [pad]), r.ints([0])])])
    m = r.emit("Cast", [member], attrs=[("to", "i", elem(dt))])
    if per_sample_weights is not None:
        m = r.emit("Mul", [m, r.emit("Unsqueeze", [r.v(per_sample_weights, dt), r.ints([0])])])
    if mode == 1:
        count = r.emit("ReduceSum", [m, r.ints([1])], attrs=[("keepdims", "i", 1)])
        m = r.emit("Div", [m, r.emit("Max", [count, r.v(1.0, dt)])])
    y = r.emit("MatMul", [m, r.emit("Gather", [r.v(w), ids], attrs=[("axis", "i", 0)])])
    return [y, None, None, None]


@rule("gather")
def _gather(r, out, a, dim, index, sparse_grad=False):
    """GatherND with each element's full coordinates: its own position on every axis but dim, the
    index on dim (its gradient, GatherND's, adds into the gathered places)."""
    rank, shape = index.dim(), list(index.shape)
    if rank == 0:
        raise NotCaptured("gather with a 0-d index")
    dim = _axis(dim, rank)
    parts = []
    for d in range(rank):
        if d == dim:
            parts.append(r.emit("Unsqueeze", [r.v(index, torch.int64), r.ints([rank])]))
        else:
            pos = torch.arange(shape[d]).view([-1 if k == d else 1 for k in range(rank)]).expand(shape)
            parts.append(r.v(pos.unsqueeze(-1).contiguous()))
    coords = r.emit("Concat", parts, attrs=[("axis", "i", rank)]) if len(parts) > 1 else parts[0]
    return r.emit("GatherND", [r.v(a), coords])


def _one_hot(r, index, n):
    """For each element of index, a row of n booleans, true where the index is: index's shape + [n]."""
    rank = index.dim()
    return r.emit("Equal", [r.emit("Unsqueeze", [r.v(index, torch.int64), r.ints([rank])]),
                            r.v(torch.arange(n).view([1] * rank + [n]))])


def _scatter_sums(r, dt, a, dim, index, srcs):
    """For each of srcs, the sum of its elements into their index along dim, in a's shape, as a
    one-hot product: for each element of index, a row of a.shape[dim] (1 where the index is), times
    its src element, summed over dim (its cost: index's size times a.shape[dim]). The one-hot is
    made once for all srcs."""
    rank = a.dim()
    dim = _axis(dim, rank)
    shape, n = list(index.shape), a.shape[dim]
    hot = r.emit("Cast", [_one_hot(r, index, n)], attrs=[("to", "i", elem(dt))])
    perm = list(range(dim)) + [rank - 1] + list(range(dim, rank - 1))
    pad = [0 if d == dim else a.shape[d] - shape[d] for d in range(rank)]
    ys = []
    for src in srcs:
        s = r.v(src, dt)
        if list(src.shape) != shape:  # only src's leading block of index's shape is read
            s = r.emit("Slice", [s, r.ints([0] * rank), r.ints(shape), r.ints(range(rank)), r.ints([1] * rank)])
        y = r.emit("Mul", [hot, r.emit("Unsqueeze", [s, r.ints([rank])])])
        y = r.emit("ReduceSum", [y, r.ints([dim])], attrs=[("keepdims", "i", 0)])  # [..., n] without dim
        y = r.emit("Transpose", [y], attrs=[("perm", "I", perm)])
        if any(pad):  # index shorter than a on another axis: nothing added there
            y = r.emit("Pad", [y, r.ints([0] * rank + pad), r.v(0, dt)], attrs=[("mode", "s", "constant")])
        ys.append(y)
    return ys


@rule("scatter_add", "scatter_add_")
def _scatter_add(r, out, a, dim, index, src):
    """a + the sum of src's elements into their index along dim."""
    return r.emit("Add", [r.v(a, out.dtype), _scatter_sums(r, out.dtype, a, dim, index, [src])[0]])


@rule("topk")
def _topk(r, out, a, k, dim=-1, largest=True, sorted=True):
    """graft's TopK: values and int64 indices along dim, ties by the lower index, NaN largest."""
    if a.dim() == 0:
        raise NotCaptured("topk of a 0-d tensor")
    return r.emit("TopK", [r.v(a), r.ints([int(k)])], nout=2,
                  attrs=[("axis", "i", _axis(dim, a.dim())), ("largest", "i", int(bool(largest))),
                         ("sorted", "i", 1)])


@rule("sort")
def _sort(r, out, a, dim=-1, descending=False, stable=None):
    """A sort is a TopK of every element. Equal values come in index order (a stable sort; PyTorch's
    unstable sort may order the indices of ties otherwise, the values are the same)."""
    if a.dim() == 0:
        raise NotCaptured("sort of a 0-d tensor")
    d = _axis(dim, a.dim())
    return r.emit("TopK", [r.v(a), r.ints([a.shape[d]])], nout=2,
                  attrs=[("axis", "i", d), ("largest", "i", int(bool(descending))), ("sorted", "i", 1)])


@rule("_trilinear")
def _trilinear(r, out, i1, i2, i3, expand1, expand2, expand3, sumdim, unroll_dim=1):
    """Each input unsqueezed at its expand dims, the three multiplied, summed over sumdim (how
    nn.Bilinear runs): one graft Einsum, whose kernel contracts pairwise by GEMMs."""
    rank = i1.dim() + len(expand1)
    letters = "abcdefghijklmnopqrstuvwxyz"[:rank]

    def term(expand):
        return "".join(letters[p] for p in range(rank) if p not in set(expand))
    eq = f"{term(expand1)},{term(expand2)},{term(expand3)}->{term(sumdim)}"
    return r.emit("Einsum", [r.v(i1), r.v(i2), r.v(i3)], attrs=[("equation", "s", eq)])


def _one_hot_taps(c, kh, kw, dtype):
    """[C*K, 1, kh, kw]: filter c*K + k picks kernel tap k of channel c (k = i * kw + j), so a
    convolution with group C is nn.Unfold and its transpose nn.Fold."""
    k = kh * kw
    w = torch.zeros(c * k, 1, kh, kw, dtype=dtype)
    for ch in range(c):
        for t in range(k):
            w[ch * k + t, 0, t // kw, t % kw] = 1
    return w


def _fold_attrs(kernel_size, dilation, padding, stride, c):
    return [("kernel_shape", "I", list(kernel_size)), ("dilations", "I", list(dilation)),
            ("pads", "I", list(padding) * 2), ("strides", "I", list(stride)), ("group", "i", c)]


@rule("im2col")
def _im2col(r, out, a, kernel_size, dilation, padding, stride):
    """nn.Unfold: a Conv with one-hot filters, group C ([N, C*K, OH, OW]), flattened to
    [N, C*K, L]; its gradient, the transposed Conv, is nn.Fold's sum of overlapping taps."""
    x = r.v(a)
    if a.dim() == 3:  # unbatched
        x = r.emit("Unsqueeze", [x, r.ints([0])])
    c = a.shape[-3]
    w = r.v(_one_hot_taps(c, kernel_size[0], kernel_size[1], out.dtype))
    y = r.emit("Conv", [x, w], attrs=_fold_attrs(kernel_size, dilation, padding, stride, c))
    return r.emit("Reshape", [y, r.ints(list(out.shape))])


@rule("col2im")
def _col2im(r, out, a, output_size, kernel_size, dilation, padding, stride):
    """nn.Fold: the ConvTranspose of nn.Unfold's one-hot Conv (overlapping taps add up), with
    output_padding to reach output_size."""
    batched = a.dim() == 3
    ck, length = a.shape[-2], a.shape[-1]
    kh, kw = kernel_size
    c = ck // (kh * kw)
    o = [(output_size[i] + 2 * padding[i] - dilation[i] * (kernel_size[i] - 1) - 1) // stride[i] + 1 for i in (0, 1)]
    if o[0] * o[1] != length or c * kh * kw != ck:
        raise NotCaptured(f"col2im of {list(a.shape)} into {list(output_size)}: the blocks do not fit")
    x = r.emit("Reshape", [r.v(a), r.ints([a.shape[0] if batched else 1, ck, o[0], o[1]])])
    # The rows / columns past the last block's reach: (output + 2 pad - dilation (k - 1) - 1) mod
    # stride, always under the stride, so ConvTranspose's output_padding covers them.
    opad = [(output_size[i] + 2 * padding[i] - dilation[i] * (kernel_size[i] - 1) - 1) % stride[i] for i in (0, 1)]
    w = r.v(_one_hot_taps(c, kh, kw, out.dtype))
    y = r.emit("ConvTranspose", [x, w], attrs=_fold_attrs(kernel_size, dilation, padding, stride, c)
               + [("output_padding", "I", opad)])
    return y if batched else r.emit("Squeeze", [y, r.ints([0])])


def _upsample(mode, linear_family, exact=False):
    """F.interpolate / nn.Upsample as graft's Resize (ONNX's, with its gradient ResizeGrad). The
    aten op comes as .vec (input, output_size | None, [align_corners,] scale_factors | None) or
    .default (input, output_size, [align_corners,] scale per axis ...). PyTorch maps coordinates
    with the given scale when there is one (1 / scale, not in / out), so the scales go to Resize
    as they are (float64) when given, else the sizes."""
    def fn(r, out, a, *rest):
        rank = a.dim()
        align = bool(rest[1]) if linear_family else False
        tail = list(rest[2:] if linear_family else rest[1:])
        if len(tail) == 1 and (tail[0] is None or isinstance(tail[0], (list, tuple))):
            tail = list(tail[0]) if tail[0] is not None else []
        scales = [float(s) for s in tail] if tail and all(s is not None for s in tail) else None
        attrs = [("mode", "s", mode)]
        if mode == "nearest":
            attrs += ([("coordinate_transformation_mode", "s", "half_pixel"), ("nearest_mode", "s", "round_prefer_ceil")]
                      if exact else [("coordinate_transformation_mode", "s", "asymmetric"),
                                     ("nearest_mode", "s", "floor")])
        else:
            attrs.append(("coordinate_transformation_mode", "s", "align_corners" if align else "pytorch_half_pixel"))
        if mode == "cubic":
            attrs += [("cubic_coeff_a", "f", -0.75), ("exclude_outside", "i", 0)]
        if scales is not None and not align:
            if [int(a.shape[2 + i] * s) for i, s in enumerate(scales)] != list(out.shape[2:]):
                raise NotCaptured(f"upsampling {list(a.shape)} by {scales} to {list(out.shape)}")
            given = r.v(torch.tensor([1.0, 1.0] + scales, dtype=torch.float64))
            return r.emit("Resize", [r.v(a), "", given], attrs=attrs)
        return r.emit("Resize", [r.v(a), "", "", r.ints(list(out.shape))], attrs=attrs)
    return fn


for _n, _m, _lin, _ex in (("upsample_nearest1d", "nearest", False, False), ("upsample_nearest2d", "nearest", False, False),
                          ("upsample_nearest3d", "nearest", False, False),
                          ("_upsample_nearest_exact1d", "nearest", False, True),
                          ("_upsample_nearest_exact2d", "nearest", False, True),
                          ("_upsample_nearest_exact3d", "nearest", False, True),
                          ("upsample_linear1d", "linear", True, False), ("upsample_bilinear2d", "linear", True, False),
                          ("upsample_trilinear3d", "linear", True, False), ("upsample_bicubic2d", "cubic", True, False)):
    RULES[_n] = _upsample(_m, _lin, _ex)


@rule("upsample")
def _upsample_whole(r, out, x, op, size, align_corners, scales):
    """graft::upsample (_aten._interpolate_whole): the aten op's rule, on its .vec arguments."""
    if op not in _INTERPOLATE.values():
        raise NotCaptured(f"graft::upsample of {op}")
    return RULES[op](r, out, x, size, *([align_corners] if takes_align_corners(op) else []), scales)


# --- unary math (src/ops/math.cpp) and what composes from it ---------------------------------------
for _n, _o in (("tan", "Tan"), ("asin", "Asin"), ("acos", "Acos"), ("atan", "Atan"), ("sinh", "Sinh"),
               ("cosh", "Cosh"), ("asinh", "Asinh"), ("acosh", "Acosh"), ("atanh", "Atanh"), ("floor", "Floor"),
               ("ceil", "Ceil")):
    RULES[_n] = (lambda op: lambda r, out, a: r.emit(op, [r.v(a)]))(_o)
for _n, _o in (("trunc", "Trunc"), ("fix", "Trunc"), ("expm1", "Expm1"), ("log1p", "Log1p")):
    RULES[_n] = (lambda op: lambda r, out, a: r.emit(op, [r.v(a)], domain="graft"))(_o)


@rule("round")
def _round(r, out, a, decimals=0):
    """Half to even, as PyTorch; with decimals, of a * 10^d (then / 10^d), as PyTorch computes it."""
    if not decimals:
        return r.emit("Round", [r.v(a)])
    scale = r.v(10.0 ** decimals, out.dtype)
    return r.emit("Div", [r.emit("Round", [r.emit("Mul", [r.v(a), scale])]), scale])


def _log_in(base):
    import math

    def fn(r, out, a):
        return r.emit("Mul", [r.emit("Log", [r.v(a)]), r.v(1.0 / math.log(base), out.dtype)])
    return fn


RULES["log2"], RULES["log10"] = _log_in(2.0), _log_in(10.0)


@rule("frac")
def _frac(r, out, a):
    x = r.v(a)
    return r.emit("Sub", [x, r.emit("Trunc", [x], domain="graft")])


@rule("isnan")
def _isnan(r, out, a):
    x = r.v(a)
    return r.emit("Not", [r.emit("Equal", [x, x])])


@rule("isinf")
def _isinf(r, out, a):
    return r.emit("Equal", [r.emit("Abs", [r.v(a)]), r.v(float("inf"), a.dtype)])


def _mod(rounding):
    """fmod (trunc) and remainder (floor): a - round(a / b) * b; d/da = 1, d/db = -round(a / b),
    PyTorch's gradients. Integers: graft's integer Div truncates (C's), so a - (a / b) * b is
    fmod exactly; remainder adds b where that is nonzero and its sign differs from b's (Python's
    %, PyTorch's remainder)."""
    def fn(r, out, a, b):
        if not out.dtype.is_floating_point:
            x, y = r.v(a, out.dtype), r.v(b, out.dtype)
            rem = r.emit("Sub", [x, r.emit("Mul", [r.emit("Div", [x, y]), y])])
            if rounding == "Trunc":
                return rem
            zero = r.v(0, out.dtype)
            flip = r.emit("And", [r.emit("Not", [r.emit("Equal", [rem, zero])]),
                                  r.emit("Xor", [r.emit("Less", [rem, zero]), r.emit("Less", [y, zero])])])
            return r.emit("Where", [flip, r.emit("Add", [rem, y]), rem])
        x, y = r.v(a, out.dtype), r.v(b, out.dtype)
        q = r.emit(rounding, [r.emit("Div", [x, y])], domain="graft" if rounding == "Trunc" else "")
        return r.emit("Sub", [x, r.emit("Mul", [q, y])])
    return fn


RULES["fmod"], RULES["remainder"] = _mod("Trunc"), _mod("Floor")


@rule("amin")
def _amin(r, out, a, dims=(), keepdim=False):
    return r.emit("ReduceMin", [r.v(a)], attrs=[("axes", "I", _reduce_axes(a, dims)), ("keepdims", "i", int(keepdim))])


@rule("flip")
def _flip(r, out, a, dims):
    """A Slice with step -1 on each flipped axis."""
    axes = sorted({_axis(d, a.dim()) for d in dims})
    if not axes:
        return r.emit("Identity", [r.v(a)])
    big = 2 ** 62
    return r.emit("Slice", [r.v(a), r.ints([-1] * len(axes)), r.ints([-big] * len(axes)), r.ints(axes),
                            r.ints([-1] * len(axes))])


def _var_args(a, args, kw):
    """(axes, correction, keepdim) of var / std in any of their overloads: (self, unbiased),
    (self, dim, unbiased, keepdim), (self, dim, *, correction, keepdim)."""
    args = list(args)
    dim, unbiased = None, True
    if args and isinstance(args[0], bool):
        unbiased = args.pop(0)
    elif args:
        dim = args.pop(0)
    if args:
        unbiased = args.pop(0)
    keepdim = args.pop(0) if args else kw.get("keepdim", False)
    correction = kw.get("correction")
    if correction is None:
        correction = 1 if unbiased else 0
    return _reduce_axes(a, dim), float(correction), bool(keepdim)


def _variance(r, out, a, args, kw):
    axes, correction, keepdim = _var_args(a, args, kw)
    n = 1
    for d in axes:
        n *= a.shape[d]
    x = r.v(a)
    mean = r.emit("ReduceMean", [x], attrs=[("axes", "I", axes), ("keepdims", "i", 1)])
    d = r.emit("Sub", [x, mean])
    s = r.emit("ReduceSum", [r.emit("Mul", [d, d]), r.ints(axes)], attrs=[("keepdims", "i", int(keepdim))])
    dt = a.dtype
    var = r.emit("Div", [s, r.v(max(n - correction, 0.0), dt)])  # n <= correction: inf / nan, as PyTorch
    mean_out = mean if keepdim else r.emit("ReduceMean", [x], attrs=[("axes", "I", axes), ("keepdims", "i", 0)])
    return var, mean_out


@rule("var")
def _var(r, out, a, *args, **kw):
    return _variance(r, out, a, args, kw)[0]


@rule("std")
def _std(r, out, a, *args, **kw):
    return r.emit("Sqrt", [_variance(r, out, a, args, kw)[0]])


@rule("var_mean")
def _var_mean(r, out, a, *args, **kw):
    v, m = _variance(r, out[0], a, args, kw)
    return [v, m]


@rule("std_mean")
def _std_mean(r, out, a, *args, **kw):
    v, m = _variance(r, out[0], a, args, kw)
    return [r.emit("Sqrt", [v]), m]


@rule("py_function")
def _py_function(r, out, xs, key):
    """A custom autograd.Function (Note [PythonOp], _pyfunc.py): graft.PythonOp, run by PyTorch."""
    from . import _pyfunc
    rec = _pyfunc.record(key)
    dims = [int(d) for _, shape in rec.outputs for d in shape]
    return r.emit("PythonOp", [r.v(x) for x in xs], nout=len(rec.outputs), domain="graft",
                  attrs=[("fn", "i", int(key)), ("name", "s", rec.name),
                         ("out_dtypes", "I", [elem(dt, f"an output of {rec.name}") for dt, _ in rec.outputs]),
                         ("out_ranks", "I", [len(shape) for _, shape in rec.outputs]), ("out_dims", "I", dims),
                         ("saved_bytes", "i", int(getattr(rec, "saved", 0)))])


@rule("diagonal")
def _diagonal(r, out, a, offset=0, dim1=0, dim2=1):
    """The two dims moved last and flattened, the diagonal's flat positions gathered (Gather's
    gradient scatters back into them): shape [other dims..., diagonal]."""
    rank = a.dim()
    d1, d2 = _axis(dim1, rank), _axis(dim2, rank)
    n1, n2 = a.shape[d1], a.shape[d2]
    rows = torch.arange(max(0, min(n1 - max(-offset, 0), n2 - max(offset, 0)))) + max(-offset, 0)
    flat = rows * n2 + (rows - max(-offset, 0) + max(offset, 0))
    others = [d for d in range(rank) if d not in (d1, d2)]
    x = r.emit("Transpose", [r.v(a)], attrs=[("perm", "I", others + [d1, d2])])
    x = r.emit("Reshape", [x, r.ints([a.shape[d] for d in others] + [n1 * n2])])
    return r.emit("Gather", [x, r.v(flat)], attrs=[("axis", "i", len(others))])


@rule("scatter", "scatter_")
def _scatter(r, out, a, dim, index, src=None, value=None, reduce=None):
    """a with src's elements (or a number) written at their index along dim: their sum into a's
    shape where some index hits, a elsewhere. Indices must not repeat within a slice (where they
    do, PyTorch keeps one of the writes, unspecified which: graft their sum)."""
    if reduce is not None:
        raise NotCaptured(f"scatter with reduce={reduce!r}")
    if src is None or not isinstance(src, torch.Tensor):
        val = src if src is not None else value
        src = torch.full(tuple(index.shape), float(val), dtype=out.dtype)
    ones = torch.ones(tuple(index.shape), dtype=out.dtype)
    added, hits = _scatter_sums(r, out.dtype, a, dim, index, [src, ones])
    hit = r.emit("Greater", [hits, r.v(0.0, out.dtype)])
    return r.emit("Where", [hit, added, r.v(a, out.dtype)])


@rule("_ctc_loss", "ctc_loss")
def _ctc_loss(r, out, log_probs, targets, input_lengths, target_lengths, blank=0, zero_infinity=False):
    """graft's CTCLoss (src/ops/ctc.cpp): the per-sequence negative log likelihood; PyTorch's
    ctc_loss applies the reduction around it with ops the table has. Output 1 (log_alpha, for
    PyTorch's own backward) is not made."""
    def lengths(v):
        return r.ints([int(x) for x in v]) if isinstance(v, (list, tuple)) else r.v(v, torch.int64)
    nll = r.emit("CTCLoss", [r.v(log_probs), r.v(targets, torch.int64), lengths(input_lengths),
                             lengths(target_lengths)], domain="graft",
                 attrs=[("blank", "i", int(blank)), ("zero_infinity", "i", int(bool(zero_infinity)))])
    return [nll, ""] if isinstance(out, (list, tuple)) else nll


def _attention(r, q, k, v, attn_mask, scale, is_causal, dropout_p=0.0):
    """graft's fused Attention (src/ops/attention.cpp, Note [fused attention]), which never holds
    the T x T probabilities: the attention and each query row's log-sum-exp."""
    if q.dim() != 4 or k.dim() != 4 or v.dim() != 4:
        raise NotCaptured("fused attention of inputs that are not 4-D")
    ins = [r.v(q), r.v(k), r.v(v), ""]
    if attn_mask is not None:
        if attn_mask.dtype not in (torch.bool, q.dtype):
            raise NotCaptured(f"an attention mask of dtype {attn_mask.dtype} with queries of {q.dtype}")
        ins[3] = r.v(attn_mask)
    if scale is not None:  # an input, not a float attribute: ONNX's are float32
        ins.append(r.v(torch.tensor(float(scale), dtype=torch.float64)))
    while not ins[-1]:
        ins.pop()
    attrs = [("causal", "i", int(bool(is_causal)))]
    if dropout_p:
        r.has_dropout = True  # (a seed per call: Note [attention dropout])
        attrs.append(("dropout", "f", float(dropout_p)))
    return r.emit("Attention", ins, attrs=attrs, nout=2, domain="graft")


@rule("_scaled_dot_product_flash_attention_for_cpu")
def _sdpa_cpu(r, out, q, k, v, dropout_p=0.0, is_causal=False, attn_mask=None, scale=None):
    """torch 2.x's scaled_dot_product_attention on the CPU: the attention and each query row's
    log-sum-exp (what PyTorch's kernel returns too)."""
    if dropout_p:
        raise NotCaptured("fused attention with dropout (PyTorch's CPU kernel has none)")
    o, lse = _attention(r, q, k, v, attn_mask, scale, is_causal)
    return [o, lse]


@rule("attention")
def _graft_attention(r, out, q, k, v, mask, dropout_p, is_causal, scale):
    """graft::attention: F.scaled_dot_product_attention with dropout (_aten._attention_op)."""
    return _attention(r, q, k, v, mask, scale, is_causal, dropout_p)[0]


# --- distances, products, masked and reducing scatters --------------------------------------------
@rule("atan2", "atan2_", "arctan2")
def _atan2(r, out, y, x):
    if not out.is_floating_point():
        raise NotCaptured("atan2 of integers")
    return r.emit("Atan2", _operands(r, out, y, x, dtype=out.dtype), domain="graft")


@rule("prod")
def _prod(r, out, a, dim=None, keepdim=False, dtype=None):
    """ReduceProd (its gradient zero-safe, as PyTorch's prod_backward) over dim or all axes."""
    if not out.is_floating_point() or (dtype is not None and dtype != a.dtype):
        raise NotCaptured("prod of integers or with a dtype (graft's ReduceProd keeps the input's float dtype)")
    axes = _reduce_axes(a, dim)
    return r.emit("ReduceProd", [r.v(a)], attrs=[("axes", "I", axes), ("keepdims", "i", int(keepdim))])


@rule("_cdist_forward", "cdist", "_euclidean_dist")
def _cdist(r, out, x1, x2, p=2.0, compute_mode=None):
    """torch.cdist as the norm of every pairwise difference ([..., P, 1, M] - [..., 1, R, M]): exact
    (no |x|^2 - 2xy + |y|^2 cancellation) at the cost of a [..., P, R, M] intermediate. Also
    _euclidean_dist, which PyTorch's cdist calls over 25 rows: the same distances, computed through
    a matrix product there (graft's are the exact ones; the gradient is the same formula)."""
    rank = x1.dim()
    d = r.emit("Sub", [r.emit("Unsqueeze", [r.v(x1), r.ints([rank - 1])]),
                       r.emit("Unsqueeze", [r.v(x2), r.ints([rank - 2])])])
    return _p_norm(r, d, [-1], float(p))


@rule("_pdist_forward", "pdist")
def _pdist(r, out, x, p=2.0):
    """torch.pdist: the distance of every row pair i < j, in PyTorch's order (row-major upper triangle)."""
    n = x.shape[0]
    i, j = torch.triu_indices(n, n, offset=1)
    a = r.emit("Gather", [r.v(x), r.v(i.contiguous())], attrs=[("axis", "i", 0)])
    b = r.emit("Gather", [r.v(x), r.v(j.contiguous())], attrs=[("axis", "i", 0)])
    return _p_norm(r, r.emit("Sub", [a, b]), [-1], float(p))


@rule("masked_scatter", "masked_scatter_")
def _masked_scatter(r, out, a, mask, source):
    """a with source's leading elements, in order, where mask (broadcast to a) is true: source's
    flat element cumsum(mask) - 1 gathered into place (its gradient adds back into source)."""
    shape = list(out.shape)
    m = r.emit("Expand", [r.v(mask, torch.bool), r.ints(shape)])
    pos = r.emit("CumSum", [r.emit("Reshape", [r.emit("Cast", [m], attrs=[("to", "i", elem(torch.int64))]),
                                                r.ints([-1])]), r.v(torch.tensor(0))])
    pos = r.emit("Max", [r.emit("Sub", [pos, r.v(torch.tensor(1))]), r.v(torch.tensor(0))])
    flat = r.emit("Reshape", [r.v(source, out.dtype), r.ints([-1])])
    got = r.emit("Reshape", [r.emit("Gather", [flat, pos], attrs=[("axis", "i", 0)]), r.ints(shape)])
    return r.emit("Where", [m, got, r.v(a, out.dtype)])


@rule("scatter_reduce", "scatter_reduce_")
def _scatter_reduce(r, out, a, dim, index, src, reduce, include_self=True):
    """scatter_reduce with sum, mean, amax and amin (floats). sum and mean through the one-hot sums
    of scatter_add; amax / amin as one ReduceMax / ReduceMin over each place's candidates (a's own
    element, where include_self, beside every src element whose index is that place), so that the
    gradient is split evenly between all tying candidates, as PyTorch's scatter_reduce backward
    (which, without include_self, also counts a's element where it ties and drops its share)."""
    dt = out.dtype
    if not out.is_floating_point() or reduce not in ("sum", "mean", "amax", "amin"):
        raise NotCaptured(f"scatter_reduce with reduce={reduce!r} on {dt} (graft has sum, mean, amax and amin of floats)")
    ones = torch.ones(tuple(index.shape), dtype=dt)
    base = r.v(a, dt)
    if reduce in ("sum", "mean"):
        added, hits = _scatter_sums(r, dt, a, dim, index, [src, ones])
        hit = r.emit("Greater", [hits, r.v(0.0, dt)])
        if include_self:
            added, hits = r.emit("Add", [added, base]), r.emit("Add", [hits, r.v(1.0, dt)])
        if reduce == "mean":
            added = r.emit("Div", [added, r.emit("Max", [hits, r.v(1.0, dt)])])
        return r.emit("Where", [hit, added, base])
    rank = a.dim()
    dim = _axis(dim, rank)
    n, shape = a.shape[dim], list(index.shape)
    if any(shape[d] != a.shape[d] for d in range(rank) if d != dim) or list(src.shape) != shape:
        raise NotCaptured(f"scatter_reduce({reduce!r}) with an index shaped {shape} for input {list(a.shape)} "
                          f"and src {list(src.shape)} (graft needs index and src alike, matching the input "
                          f"on every axis but dim)")
    hot = _one_hot(r, index, n)
    hit = r.emit("ReduceMax", [r.emit("Cast", [hot], attrs=[("to", "i", elem(dt))])],
                 attrs=[("axes", "I", [dim]), ("keepdims", "i", 1)])  # [..., 1 at dim, ..., n]
    worst = float("-inf") if reduce == "amax" else float("inf")
    cand = r.emit("Where", [hot, r.emit("Unsqueeze", [r.v(src, dt), r.ints([rank])]), r.v(worst, dt)])
    op = "ReduceMax" if reduce == "amax" else "ReduceMin"
    # a's element, its place along dim moved last, as one more candidate along dim
    to_last = list(range(dim)) + list(range(dim + 1, rank)) + [dim]
    mine = r.emit("Unsqueeze", [r.emit("Transpose", [base], attrs=[("perm", "I", to_last)]), r.ints([dim])])
    if not include_self:
        # PyTorch's backward still counts a's element among the ties when it equals the result (and
        # then drops its share): a stopped candidate, there only where it ties, does the same.
        y0 = r.emit(op, [cand], attrs=[("axes", "I", [dim]), ("keepdims", "i", 1)])
        mine = r.emit("StopGradient", [r.emit("Where", [r.emit("Equal", [mine, y0]), mine, r.v(worst, dt)])],
                      domain="graft")
    cand = r.emit("Concat", [cand, mine], attrs=[("axis", "i", dim)])
    y = r.emit(op, [cand], attrs=[("axes", "I", [dim]), ("keepdims", "i", 1)])  # [..., 1, ..., n]
    back = list(range(dim)) + [rank] + list(range(dim + 1, rank)) + [dim]  # swap dim and the last axis
    y = r.emit("Squeeze", [r.emit("Transpose", [y], attrs=[("perm", "I", back)]), r.ints([rank])])
    hit = r.emit("Squeeze", [r.emit("Transpose", [hit], attrs=[("perm", "I", back)]), r.ints([rank])])
    return r.emit("Where", [r.emit("Greater", [hit, r.v(0.0, dt)]), y, base])


@rule("grid_sampler_2d", "grid_sampler")
def _grid_sampler(r, out, x, grid, interpolation_mode=0, padding_mode=0, align_corners=False):
    """F.grid_sample on images: ONNX's GridSample (src/ops/grid_sample.cpp), bilinear or nearest,
    zeros or border padding; bicubic and reflection are refused naming themselves."""
    modes, pads = {0: "bilinear", 1: "nearest"}, {0: "zeros", 1: "border"}
    if x.dim() != 4:
        raise NotCaptured(f"grid_sample of a {x.dim()}-D input (graft samples 4-D images)")
    if interpolation_mode not in modes or padding_mode not in pads:
        raise NotCaptured(f"grid_sample with mode {['bilinear', 'nearest', 'bicubic'][interpolation_mode]!r} and "
                          f"padding_mode {['zeros', 'border', 'reflection'][padding_mode]!r} (graft has bilinear "
                          f"and nearest, zeros and border)")
    return r.emit("GridSample", [r.v(x), r.v(grid, x.dtype)],
                  attrs=[("mode", "s", modes[interpolation_mode]), ("padding_mode", "s", pads[padding_mode]),
                         ("align_corners", "i", int(bool(align_corners)))])
