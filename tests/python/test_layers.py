"""A catalogue of torch.nn layers GraftModule's capture composes from graft ops (python/graft/
_aten_layers.py): each one layer after a Linear or a convolution, trained 2 SGD steps in float64
against an eager copy, outputs, losses, every .grad, parameters and buffers compared, and captured
(not exported).

Run with the compiled package on the path:  PYTHONPATH=build/python python3 -m pytest tests/python/test_layers.py
"""

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import parity
import graft
from graft.frontend import GraftModule

pytestmark = pytest.mark.filterwarnings("ignore::torch.jit.TracerWarning", "ignore::DeprecationWarning",
                                        "ignore::UserWarning")


def train_both(model, make_inputs, dtype=torch.float64, tol=(1e-7, 1e-9)):
    """parity.train_both in float64 with tight tolerances by default."""
    return parity.train_both(model, make_inputs, dtype=dtype, rtol=tol[0], atol=tol[1])


class Fn(nn.Module):
    """pre (a Linear or convolution), then fn(self, its output, *the other inputs)."""

    def __init__(self, pre, fn, **mods):
        super().__init__()
        self.pre, self.fn = pre, fn
        for k, m in mods.items():
            setattr(self, k, m)

    def forward(self, x, *rest):
        return self.fn(self, self.pre(x), *rest)


def gen(step):
    return torch.Generator().manual_seed(100 + step)


def image(step, shape=(2, 3, 6, 6)):
    return (torch.randn(*shape, generator=gen(step), dtype=torch.float64),)


def vector(step, shape=(5, 6)):
    return (torch.randn(*shape, generator=gen(step), dtype=torch.float64) * 2,)


def conv(cout=4, cin=3):
    return nn.Conv2d(cin, cout, 3, padding=1)


def after_conv(layer, cout=4):
    return lambda: nn.Sequential(conv(cout), layer), image


def after_linear(layer, d=8):
    return lambda: nn.Sequential(nn.Linear(6, d), layer), vector


def fn_conv(f, cout=4, **mods):
    return lambda: Fn(conv(cout), f, **mods), image


def seq_input(step):
    return (torch.randn(2, 3, 7, generator=gen(step), dtype=torch.float64),)


def classify(step, ignore=False):
    t = torch.randint(0, 4, (6,), generator=gen(step))
    if ignore:
        t[1] = t[4] = -100
    return torch.randn(6, 6, generator=gen(step), dtype=torch.float64), t


def multilabel(step):
    return torch.randn(5, 6, generator=gen(step), dtype=torch.float64), \
        torch.rand(5, 4, generator=gen(step), dtype=torch.float64)


def bags_2d(step):
    return (torch.randint(0, 10, (4, 3), generator=gen(step)),)


def bags_offsets(step):  # 4 bags of 7 indices, the second empty, a 3 (padding_idx below) in the third
    ids = torch.randint(0, 10, (7,), generator=gen(step))
    ids[3] = 3
    return ids, torch.tensor([0, 2, 2, 5])  # offsets: a call tensor


class Bag(nn.Module):
    def __init__(self, **kw):
        super().__init__()
        self.bag = nn.EmbeddingBag(10, 5, **kw)
        self.fc = nn.Linear(5, 3)

    def forward(self, ids, *rest):
        return self.fc(self.bag(ids, *rest))


class WeightedBag(Bag):
    def __init__(self):
        super().__init__(mode="sum")
        self.w = nn.Linear(7, 7)

    def forward(self, ids, offsets, x):
        return self.fc(self.bag(ids, offsets, per_sample_weights=self.w(x)))


def weighted_bags(step):
    return bags_offsets(step) + (torch.randn(7, generator=gen(step), dtype=torch.float64),)


def rrelu():
    m = nn.Sequential(nn.Linear(6, 8), nn.RReLU(0.1, 0.3))
    return m.eval()


def index_input(step, shape=(5, 4), hi=8):
    return torch.randn(5, 6, generator=gen(step), dtype=torch.float64), \
        torch.randint(0, hi, shape, generator=gen(step))


class Ctc(nn.Module):
    """A per-frame classifier trained with CTC, as speech and OCR models are."""

    def __init__(self, reduction, lists=False, zero_infinity=False):
        super().__init__()
        self.l = nn.Linear(5, 6)
        self.reduction, self.lists, self.zero_infinity = reduction, lists, zero_infinity

    def forward(self, x, targets, input_lengths, target_lengths):
        lp = self.l(x).log_softmax(2)
        if self.lists:
            input_lengths, target_lengths = [12, 10, 7], [4, 2, 3]
        return F.ctc_loss(lp, targets, input_lengths, target_lengths, blank=0, reduction=self.reduction,
                          zero_infinity=self.zero_infinity)


def ctc_inputs(step, impossible=False):
    """[T=12, N=3, 5] frames, padded targets [3, 4] (labels 1..5), their lengths; impossible: the
    third sequence gets fewer frames than its labels need (an infinite loss)."""
    g = gen(step)
    x = torch.randn(12, 3, 5, generator=g, dtype=torch.float64)
    targets = torch.randint(1, 6, (3, 4), generator=g)
    il = torch.tensor([12, 10, 2 if impossible else 7])  # 2 frames cannot emit 3 labels
    tl = torch.tensor([4, 2, 3])
    return x, targets, il, tl


CATALOGUE = {
    # activations
    "LeakyReLU": after_conv(nn.LeakyReLU(0.2)),
    "RReLU-eval": (rrelu, vector),
    "ELU": after_conv(nn.ELU(0.7)),
    "CELU": after_conv(nn.CELU(0.5)),  # 1/alpha exact: PyTorch's backward takes it in float32
    "SELU": after_conv(nn.SELU()),
    "Softplus": after_linear(nn.Softplus()),
    "Softplus-beta-threshold": after_linear(nn.Softplus(beta=2.0, threshold=3.0)),  # both branches taken
    "Mish": after_conv(nn.Mish()),
    "PReLU-per-channel": after_conv(nn.PReLU(4, init=0.1)),
    "PReLU-shared": after_linear(nn.PReLU(init=0.1)),
    "Threshold": after_linear(nn.Threshold(0.1, -2.0)),
    # normalization
    "LayerNorm-no-affine": after_linear(nn.LayerNorm(8, elementwise_affine=False)),
    "GroupNorm": after_conv(nn.GroupNorm(2, 4)),
    "GroupNorm-no-affine": after_conv(nn.GroupNorm(4, 4, affine=False)),
    "InstanceNorm2d": after_conv(nn.InstanceNorm2d(4, affine=True)),
    "InstanceNorm2d-no-affine": after_conv(nn.InstanceNorm2d(4)),
    "InstanceNorm1d": (lambda: nn.Sequential(nn.Conv1d(3, 4, 3), nn.InstanceNorm1d(4, affine=True)), seq_input),
    # rearrangements and padding
    "PixelShuffle": after_conv(nn.PixelShuffle(2), cout=8),
    "PixelUnshuffle": after_conv(nn.PixelUnshuffle(2)),
    "pad-reflect-2d": fn_conv(lambda s, y: F.pad(y, (1, 2, 2, 1), mode="reflect")),
    "pad-replicate-2d": fn_conv(lambda s, y: F.pad(y, (2, 1, 0, 3), mode="replicate")),
    "pad-reflect-1d": (lambda: Fn(nn.Conv1d(3, 4, 3), lambda s, y: F.pad(y, (2, 1), mode="reflect")), seq_input),
    "pad-replicate-1d": (lambda: Fn(nn.Conv1d(3, 4, 3), lambda s, y: F.pad(y, (0, 3), mode="replicate")),
                         seq_input),
    "pad-constant": fn_conv(lambda s, y: F.pad(y, (1, 2, -1, 1), value=0.5)),  # a negative pad crops
    "ZeroPad2d": after_conv(nn.ZeroPad2d((1, 0, 2, 1))),
    "Conv2d-padding_mode-reflect": (lambda: nn.Conv2d(3, 4, 3, padding=2, padding_mode="reflect"), image),
    "Conv2d-padding_mode-replicate": (lambda: nn.Conv2d(3, 4, 3, padding=1, padding_mode="replicate"), image),
    # losses and reductions
    "cross_entropy-label_smoothing": (
        lambda: Fn(nn.Linear(6, 4), lambda s, y, t: F.cross_entropy(y, t, label_smoothing=0.1)), classify),
    "cross_entropy-label_smoothing-ignored-rows": (
        lambda: Fn(nn.Linear(6, 4), lambda s, y, t: F.cross_entropy(y, t, label_smoothing=0.2)),
        lambda step: classify(step, ignore=True)),
    "cross_entropy-label_smoothing-sum": (
        lambda: Fn(nn.Linear(6, 4), lambda s, y, t: F.cross_entropy(y, t, label_smoothing=0.1, reduction="sum")),
        classify),
    "BCEWithLogits-pos_weight": (
        lambda: Fn(nn.Linear(6, 4), lambda s, y, t: s.loss(y * 3, t),
                   loss=nn.BCEWithLogitsLoss(pos_weight=torch.tensor([1.0, 2.0, 3.0, 0.5]))), multilabel),
    "BCEWithLogits-weight-sum": (
        lambda: Fn(nn.Linear(6, 4), lambda s, y, t: s.loss(y, t),
                   loss=nn.BCEWithLogitsLoss(weight=torch.tensor([0.5, 1.0, 2.0, 1.0]), reduction="sum",
                                             pos_weight=torch.tensor([2.0, 1.0, 1.0, 4.0]))), multilabel),
    "logsumexp": fn_conv(lambda s, y: torch.logsumexp(y, dim=1)),
    "logsumexp-keepdim": fn_conv(lambda s, y: torch.logsumexp(y * 20, dim=(-2, -1), keepdim=True)),
    # pooling
    "AdaptiveAvgPool2d": after_conv(nn.AdaptiveAvgPool2d((3, 2))),
    "AdaptiveAvgPool2d-not-divisible": after_conv(nn.AdaptiveAvgPool2d((4, 5))),
    "AdaptiveAvgPool2d-1": after_conv(nn.AdaptiveAvgPool2d(1)),
    "AdaptiveAvgPool1d-not-divisible": (lambda: nn.Sequential(nn.Conv1d(3, 4, 2), nn.AdaptiveAvgPool1d(4)), seq_input),
    "AdaptiveAvgPool3d": (lambda: nn.Sequential(nn.Conv3d(2, 3, 1), nn.AdaptiveAvgPool3d((2, 3, 1))),
                          lambda step: image(step, (2, 2, 4, 6, 5))),
    # upsampling (F.interpolate, nn.Upsample) as graft's Resize
    "Upsample-nearest-scale": after_conv(nn.Upsample(scale_factor=2)),
    "interpolate-nearest-odd-scale": fn_conv(lambda s, y: F.interpolate(y, scale_factor=1.7)),
    "interpolate-nearest-size": fn_conv(lambda s, y: F.interpolate(y, size=(7, 11))),
    "interpolate-nearest-exact": fn_conv(lambda s, y: F.interpolate(y, scale_factor=1.5, mode="nearest-exact")),
    "interpolate-bilinear-size": fn_conv(lambda s, y: F.interpolate(y, size=(9, 4), mode="bilinear")),
    "interpolate-bilinear-scale": fn_conv(lambda s, y: F.interpolate(y, scale_factor=1.7, mode="bilinear")),
    "interpolate-bilinear-align_corners": fn_conv(lambda s, y: F.interpolate(y, scale_factor=2.5, mode="bilinear",
                                                                           align_corners=True)),
    "interpolate-bicubic": fn_conv(lambda s, y: F.interpolate(y, size=(8, 10), mode="bicubic")),
    "interpolate-linear-1d": (lambda: Fn(nn.Conv1d(3, 4, 3), lambda s, y: F.interpolate(y, scale_factor=2.3,
                                                                                       mode="linear")), seq_input),
    "interpolate-nearest-1d": (lambda: Fn(nn.Conv1d(3, 4, 3), lambda s, y: F.interpolate(y, size=9)), seq_input),
    "interpolate-trilinear": (lambda: Fn(nn.Conv3d(2, 3, 1), lambda s, y: F.interpolate(y, scale_factor=2,
                                                                                       mode="trilinear")),
                              lambda step: image(step, (2, 2, 3, 2, 3))),
    "interpolate-nearest-3d": (lambda: Fn(nn.Conv3d(2, 3, 1), lambda s, y: F.interpolate(y, size=(4, 3, 5))),
                               lambda step: image(step, (2, 2, 3, 2, 3))),
    # transposed convolutions (graft's ConvTranspose: Conv's backward-data)
    "ConvTranspose2d-stride-output_padding": (
        lambda: nn.Sequential(conv(), nn.ConvTranspose2d(4, 3, 3, stride=2, padding=1, output_padding=1)), image),
    "ConvTranspose2d-groups-dilation-no-bias": (
        lambda: nn.Sequential(conv(), nn.ConvTranspose2d(4, 6, (2, 3), groups=2, dilation=(2, 1), bias=False)), image),
    "ConvTranspose2d-depthwise": (lambda: nn.Sequential(conv(), nn.ConvTranspose2d(4, 4, 3, groups=4, padding=1)),
                                  image),
    "ConvTranspose1d": (lambda: nn.Sequential(nn.Conv1d(3, 4, 3), nn.ConvTranspose1d(4, 2, 4, stride=3, padding=2,
                                                                                   output_padding=2)), seq_input),
    "ConvTranspose3d": (lambda: nn.Sequential(nn.Conv3d(2, 3, 1), nn.ConvTranspose3d(3, 2, 2, stride=2)),
                        lambda step: image(step, (2, 2, 3, 2, 3))),
    "ConvTranspose2d-first-layer": (lambda: nn.ConvTranspose2d(3, 2, 3, stride=2), image),  # no dX needed
    # selection and bilinear forms
    "topk": fn_conv(lambda s, y: torch.topk(y.flatten(1), 5, dim=1).values),
    "topk-smallest-dim0": (lambda: Fn(nn.Linear(6, 8), lambda s, y: torch.topk(y, 2, dim=0, largest=False)[0]),
                           vector),
    "topk-indices-gather": (lambda: Fn(nn.Linear(6, 8), lambda s, y: torch.gather(y * 3, 1, y.topk(3, 1).indices)),
                            vector),
    "sort-descending": fn_conv(lambda s, y: torch.sort(y, dim=2, descending=True).values * torch.arange(6.0).view(6, 1)),
    "argsort-gather": (lambda: Fn(nn.Linear(6, 8), lambda s, y: torch.gather(y, 1, torch.argsort(y.tanh(), dim=1))
                                  * torch.arange(8.0)), vector),
    "Bilinear": (lambda: Fn(nn.Linear(6, 5), lambda s, y: s.bl(y, torch.tanh(y[:, :3])), bl=nn.Bilinear(5, 3, 4)),
                 vector),
    "Bilinear-no-bias-3d": (lambda: Fn(nn.Linear(6, 5), lambda s, y: s.bl(y.view(5, 1, 5).expand(5, 2, 5), y.view(5, 1, 5)
                                                                          .expand(5, 2, 5) * 2),
                                       bl=nn.Bilinear(5, 5, 3, bias=False)), vector),
    "LocalResponseNorm": after_conv(nn.LocalResponseNorm(3, alpha=0.5, beta=0.75, k=2.0)),
    "Unfold": after_conv(nn.Unfold(kernel_size=(2, 3), dilation=(1, 2), padding=1, stride=(2, 1))),
    "Fold-overlapping": (lambda: Fn(conv(cout=8), lambda s, y: F.fold(y.flatten(2)[:, :, :30], (5, 4), 2, padding=1,
                                                                       stride=1)), image),
    "Fold-stride-uncovered-edge": (lambda: Fn(conv(cout=8), lambda s, y: F.fold(y.flatten(2)[:, :, :6], (8, 7), 2,
                                                                                 stride=3)), image),
    "Unfold-Fold-roundtrip": fn_conv(lambda s, y: F.fold(F.unfold(y, 3, padding=1) * 0.5, (6, 6), 3, padding=1)),
    # unary math (graft's math.cpp) and what composes from it
    "tan-asin-acos-atan": (lambda: Fn(nn.Linear(6, 8), lambda s, y: torch.tan(torch.tanh(y)) + torch.asin(torch.tanh(y) * 0.9)
                                      + torch.acos(torch.tanh(y * 0.5) * 0.8) * 2 + torch.atan(y) * 3), vector),
    "hyperbolic": (lambda: Fn(nn.Linear(6, 8), lambda s, y: torch.sinh(y) + torch.cosh(y * 0.5) * 2 + torch.asinh(y) * 3
                              + torch.acosh(1.5 + y * y) * 4 + torch.atanh(torch.tanh(y) * 0.9) * 5), vector),
    "expm1-log1p-log2-log10": (lambda: Fn(nn.Linear(6, 8), lambda s, y: torch.expm1(y * 1e-3) * 1e3
                                          + torch.log1p(y * y) + torch.log2(1 + y * y) * 2 + torch.log10(3 + y * y) * 3),
                               vector),
    "rounding": (lambda: Fn(nn.Linear(6, 8), lambda s, y: y * torch.floor(y * 3) + y * torch.ceil(y * 2)
                            + y * torch.round(y * 4) + y * torch.trunc(y * 3) + torch.frac(y * 3)
                            + torch.round(y, decimals=2) * y), vector),
    "isnan-isinf": (lambda: Fn(nn.Linear(6, 8), lambda s, y: torch.where(torch.isnan(torch.sqrt(y)), y * 2, y * 3)
                               + torch.where(torch.isinf(1.0 / (y > 0).to(y.dtype)), y, -y)), vector),
    "fmod-remainder": (lambda: Fn(nn.Linear(6, 8), lambda s, y: torch.fmod(y * 3, 0.7) + torch.remainder(
                           y * 3, torch.sigmoid(y) + 0.5) * 2), vector),
    "integer-remainder-fmod": (lambda: Fn(nn.Linear(6, 8), lambda s, y, i: y * (torch.remainder(i - 5, 3)
                                             + 2 * torch.fmod(i - 5, 3) + 4 * (i % -3) + 8 * (i - 6) % 4).to(y.dtype)),
                               lambda step: (vector(step)[0], torch.randint(0, 12, (5, 8), generator=gen(step)))),
    "amin-flip": (lambda: Fn(nn.Linear(6, 8), lambda s, y: torch.amin(y, dim=1) + torch.flip(y, [0, 1])[:, 0]
                             * torch.arange(5.0) + torch.flip(y, [-1]).sum(0)[:5]), vector),
    "var-std": (lambda: Fn(nn.Linear(6, 8), lambda s, y: torch.var(y, 1) + torch.var(y, 1, unbiased=False, keepdim=True)
                           .squeeze(1) * 2 + torch.std(y) + torch.std(y, dim=0)[:5]), vector),
    "var_mean-std_mean": (lambda: Fn(nn.Linear(6, 8), lambda s, y: sum(t.sum() for t in torch.var_mean(y, 0, correction=2))
                                     + torch.std_mean(y, 1, keepdim=True)[0].sum() * 3), vector),
    "diagonal": (lambda: Fn(nn.Linear(6, 8), lambda s, y: torch.diagonal(y.view(5, 2, 4), 1, 0, 2)
                            + torch.diagonal(y.view(5, 2, 4), -1, 2, 0) * 2), vector),
    "scatter-src-and-value": (lambda: Fn(nn.Linear(6, 8), lambda s, y, i: y.scatter(1, i[:, :1], y[:, 4:5] * 3)
                                         .scatter(1, i[:, 1:2], 0.5) * torch.arange(8.0)),
                              lambda step: (vector(step)[0], torch.stack([torch.randperm(8, generator=gen(step))[:2]
                                                                          for _ in range(5)]))),
    # CTC (graft's CTCLoss): tensor or list lengths, padded or concatenated targets, reductions
    "ctc_loss-mean": (lambda: Ctc("mean"), ctc_inputs),
    "ctc_loss-sum-list-lengths": (lambda: Ctc("sum", lists=True), ctc_inputs),
    "ctc_loss-none": (lambda: Ctc("none"), ctc_inputs),
    "ctc_loss-zero_infinity": (lambda: Ctc("mean", zero_infinity=True), lambda step: ctc_inputs(step, impossible=True)),
    # bags, gather, scatter
    "EmbeddingBag-mean": (lambda: Bag(mode="mean"), bags_2d),
    "EmbeddingBag-sum-offsets": (lambda: Bag(mode="sum"), bags_offsets),
    "EmbeddingBag-mean-padding_idx": (lambda: Bag(mode="mean", padding_idx=3), bags_offsets),
    "EmbeddingBag-include_last_offset": (
        lambda: Bag(mode="mean", include_last_offset=True),
        lambda step: (bags_offsets(step)[0], torch.tensor([0, 2, 2, 5, 7]))),
    "EmbeddingBag-per_sample_weights": (WeightedBag, weighted_bags),
    "gather": (lambda: Fn(nn.Linear(6, 8), lambda s, y, i: torch.gather(y, 1, i)), index_input),
    "gather-dim0": (lambda: Fn(nn.Linear(6, 8), lambda s, y, i: torch.gather(y, 0, i)),
                    lambda step: index_input(step, (3, 8), 5)),
    "scatter_add": (lambda: Fn(nn.Linear(6, 4), lambda s, y, i: torch.zeros(5, 8, dtype=y.dtype).scatter_add(1, i, y)),
                    lambda step: index_input(step, (5, 4), 8)),
    "scatter_add-into-a-value": (
        lambda: Fn(nn.Linear(6, 8), lambda s, y, i: y.scatter_add(0, i, s.src(y[:2, :6] * 2)), src=nn.Tanh()),
        lambda step: index_input(step, (2, 6), 5)),
    # products, angles, distances, masked and reducing scatters
    "atan2": (lambda: Fn(nn.Linear(6, 8), lambda s, y: torch.atan2(y[:, :4], y[:, 4:]) + torch.atan2(y, torch.tensor(0.5))[:, 2:6]
                         + torch.atan2(torch.full_like(y, -0.3), y)[:, :4]), vector),
    "prod": (lambda: Fn(nn.Linear(6, 8), lambda s, y: torch.prod(y, 1) + torch.prod(y[:, :3]) * y.prod(0, keepdim=True)[0, :5]),
             vector),
    # rows with no zero, one zero (only it gets a gradient) and two zeros (none does)
    "prod-with-zeros": (lambda: Fn(nn.Linear(6, 4), lambda s, y: (y * torch.tensor([[1.0, 1, 1, 1], [1, 0, 1, 1], [0, 1, 1, 0],
                                                                                    [1, 1, 1, 1], [1, 1, 0, 1]])).prod(1)),
                        vector),
    "cdist": (lambda: Fn(nn.Linear(6, 8), lambda s, y: torch.cdist(y[:3], y[1:] * 2).sum(1) + torch.cdist(y, y, p=1).sum(1)[:3]
                         + torch.cdist(y, y)[1:4, 0]), vector),  # cdist(y, y): zero distances, zero gradients
    "cdist-batched": (lambda: Fn(nn.Linear(6, 8), lambda s, y: torch.cdist(y.view(5, 2, 4), y.view(5, 2, 4).flip(1) * 0.5)),
                      vector),
    # over 25 rows PyTorch computes euclidean distances through a matrix product (_euclidean_dist)
    "cdist-many-rows": (lambda: Fn(nn.Linear(6, 8), lambda s, y: torch.cdist(y.repeat(6, 1)[:27] * 0.5, y.repeat(6, 1)[1:28])),
                        vector),
    "pdist": (lambda: Fn(nn.Linear(6, 8), lambda s, y: torch.pdist(y) + torch.pdist(y * 2, p=1)), vector),
    "masked_scatter": (lambda: Fn(nn.Linear(6, 8), lambda s, y: y.masked_scatter(y > 0.2, (y * 3).flip(0))
                                  + torch.zeros(8, dtype=y.dtype).masked_scatter(torch.arange(8) % 3 == 0, y[0] * 2)),
                       vector),
    # a spatial transformer: the grid from the features (its gradient too), sampled inside and
    # beyond the image
    **{f"grid_sample-{mode}-{pad}{'-align_corners' if ac else ''}": (
        (lambda mode, pad, ac: lambda: Fn(conv(4), lambda s, y: F.grid_sample(
            y, torch.tanh(s.loc(y.mean((2, 3)))).view(2, 3, 3, 2) * 1.2, mode=mode, padding_mode=pad,
            align_corners=ac), loc=nn.Linear(4, 18)))(mode, pad, ac), image)
       for mode, pad, ac in (("bilinear", "zeros", False), ("bilinear", "border", True), ("nearest", "zeros", False),
                             ("bilinear", "zeros", True))},
    **{f"scatter_reduce-{red}{'' if inc else '-exclude_self'}": (
        (lambda red, inc: lambda: Fn(nn.Linear(6, 8), lambda s, y, i: y.scatter_reduce(1, i, y[:, :6] * 1.5 if red in ("sum", "mean")
                                                                                         else y[:, :6], red, include_self=inc)))(red, inc),
        lambda step: index_input(step, (5, 6), 8))
       for red in ("sum", "mean", "amax", "amin") for inc in (True, False)},
}


@pytest.mark.parametrize("name", list(CATALOGUE))
def test_a_layer_is_captured_and_trains_as_eager(name):
    make_model, make_inputs = CATALOGUE[name]
    torch.manual_seed(0)
    g = train_both(make_model(), make_inputs)
    assert g.export_method == "capture", g.export_method


@pytest.mark.parametrize("name", ["ELU", "CELU", "SELU", "Softplus", "Mish", "BCEWithLogits-pos_weight",
                                  "logsumexp-keepdim"])
def test_large_float32_inputs_give_eager_s_finite_values(name):
    """Inputs in the hundreds: no exp overflows into a NaN (through the branch a Where does not take)."""
    make_model, make_inputs = CATALOGUE[name]

    def inputs(step):
        x, *rest = make_inputs(step)
        return (x.float() * 300,) + tuple(t.float() if t.is_floating_point() else t for t in rest)

    torch.manual_seed(0)
    g = train_both(make_model(), inputs, dtype=torch.float32, tol=(1e-5, 1e-4))
    assert g.export_method == "capture", g.export_method


def test_rrelu_in_training_mode_with_one_slope_trains_as_eager():
    """lower == upper: eager's draw is that slope, so graft's RRelu must give eager's numbers."""
    torch.manual_seed(0)
    g = train_both(nn.Sequential(nn.Linear(6, 8), nn.RReLU(0.2, 0.2), nn.Linear(8, 3)), vector)
    assert g.export_method == "capture", g.export_method


def test_rrelu_in_training_mode_draws_slopes_in_range_and_differentiates_through_them():
    """Slopes drawn by graft's stream (as Dropout's masks): each negative input's slope in
    [lower, upper), positive inputs pass, a new draw every call, and the input's gradient is the
    slope the forward used."""
    g = GraftModule(nn.RReLU(0.1, 0.3).double())
    x = torch.linspace(-3, 3, 301, dtype=torch.float64).reshape(7, 43).requires_grad_(True)
    y = g(x)
    y.sum().backward()
    neg = x.detach() < 0
    slope = (y.detach() / x.detach())
    assert torch.equal(y.detach()[~neg], x.detach()[~neg])
    assert slope[neg].min() >= 0.1 and slope[neg].max() < 0.3 and slope[neg].std() > 0.03
    torch.testing.assert_close(x.grad[neg], slope[neg])
    assert torch.all(x.grad[x.detach() > 0] == 1)
    assert not torch.equal(g(x).detach(), y.detach())  # the next call draws again
    g.eval()
    torch.testing.assert_close(g(x).detach()[neg], x.detach()[neg] * 0.2)  # eval: the mean slope


class MaskedSelect(nn.Module):
    """masked_select has a length the mask decides (torch 1.13's label-smoothed cross_entropy takes
    its mean): its mean and sum are captured, any other reader is not."""

    def __init__(self, reduce):
        super().__init__()
        self.fc, self.reduce = nn.Linear(6, 4), reduce

    def forward(self, x, mask):
        return self.reduce(torch.masked_select(self.fc(x), mask))


def masked(step):
    return torch.randn(5, 6, generator=gen(step), dtype=torch.float64), torch.rand(5, 4, generator=gen(step)) > 0.5


@pytest.mark.parametrize("reduce", [torch.mean, torch.sum])
def test_the_mean_and_sum_of_a_masked_select_are_captured(reduce):
    g = train_both(MaskedSelect(reduce), masked)
    assert g.export_method == "capture", g.export_method


def test_a_masked_select_read_otherwise_is_not_captured():
    g = GraftModule(MaskedSelect(lambda t: (t * 2).sum()).double())
    try:
        g(*masked(0))
    except Exception:  # noqa: BLE001  (the exporter's NonZero is no graft op)
        pass
    assert g.export_method.startswith("torch.onnx.export (not captured: aten::mul"), g.export_method


@pytest.mark.parametrize("name", ["ConvTranspose2d-stride-output_padding", "ConvTranspose2d-depthwise",
                                  "ConvTranspose2d-groups-dilation-no-bias", "ConvTranspose3d"])
def test_float32_transposed_convolutions_take_the_float32_kernels_and_match_eager(name):
    """In float32 the transposed convolution runs on oneDNN's backward-data primitive or graft's
    depthwise planes (float64 takes the im2col loops above): same results within float32 rounding."""
    make_model, make_inputs = CATALOGUE[name]
    torch.manual_seed(0)
    g = train_both(make_model(), lambda step: tuple(t.float() for t in make_inputs(step)), dtype=torch.float32,
                   tol=(2e-4, 1e-5))
    assert g.export_method == "capture", g.export_method


def test_ctc_loss_with_concatenated_targets_and_its_gradient_by_finite_differences():
    """Concatenated 1-D targets give the padded ones' losses; the gradient with respect to the
    frames (through log_softmax) matches finite differences in float64."""
    torch.manual_seed(0)
    m = Ctc("sum").double()
    x, targets, il, tl = ctc_inputs(0)
    flat = torch.cat([targets[i, :n] for i, n in enumerate(tl.tolist())])
    g = GraftModule(m)
    torch.testing.assert_close(g(x, flat, il, tl), m(x, targets, il, tl), rtol=1e-10, atol=1e-10)
    x = x.clone().requires_grad_(True)
    assert torch.autograd.gradcheck(lambda v: g(v, targets, il, tl), (x,), eps=1e-6, atol=1e-6)


@pytest.mark.parametrize("kw", [dict(padding_mode="reflection"), dict(mode="bicubic")])
def test_grid_sample_modes_graft_lacks_are_refused_naming_them(kw):
    model = Fn(conv(4), lambda s, y: F.grid_sample(y, torch.zeros(2, 3, 3, 2, dtype=y.dtype), align_corners=False, **kw))
    with pytest.raises(graft.GraftError, match=list(kw.values())[0]):
        GraftModule(model.double())(image(0)[0])
