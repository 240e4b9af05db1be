"""The model zoo: small models people bring to graft.GraftModule, built with random weights.

Each builder is `build(dropout)` -> Zoo(model, make_batch, loss_fn):

* model: a torch.nn.Module in training mode, random weights (the caller seeds torch first);
* make_batch(seed) -> the tuple of positional arguments for one call, the same for the same seed
  (labels included where the model computes its loss itself: HF heads with labels=...);
* loss_fn(output, batch) -> a scalar tensor, computed outside the module (a cross-entropy on the
  logits, or the loss the HF model returned).

`dropout=False` (the parity comparison): every dropout / stochastic-depth probability is 0 so that
eager and graft compute the same function. `dropout=True`: the config's default dropout.

Nothing is downloaded: the torchvision models are built with weights=None, the Hugging Face models
from tiny configs (2 layers, hidden 32, 2-4 heads, vocab 100, sequence 8, batch 2), and
HF_HUB_OFFLINE=1 is set on import so that no code path can reach the hub. torchvision and
transformers are imported by the builders that need them (transformers: build/venv-zoo, made by
tools/setup). Used by tests/python/test_zoo.py, tools/zoo-report (and the other tools that load
tools/zoo_venv.py) and bench/zoo_bench.py, which put this folder (bench/) on sys.path.

    from zoo import MODELS, build
    z = build("gpt2", dropout=False)
    batch = z.make_batch(0); loss = z.loss_fn(z.model(*batch), batch)
"""
import os
from typing import Callable, NamedTuple

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import torch  # noqa: E402
import torch.nn as nn  # noqa: E402
import torch.nn.functional as F  # noqa: E402

BATCH, SEQ, VOCAB, HIDDEN, IMAGE, CLASSES = 2, 8, 100, 32, 32, 4
LAYERS = 2  # GPT-2 and BERT (tools/recompute-report varies it, and SEQ)


class Zoo(NamedTuple):
    model: nn.Module
    make_batch: Callable[[int], tuple]
    loss_fn: Callable[[object, tuple], torch.Tensor]


def _gen(seed):
    return torch.Generator().manual_seed(1000 + seed)


# CNN images: 4 x 64x64. The deepest feature maps of resnet18 / mobilenet_v2 are then 2x2, so a
# training-mode BatchNorm there normalizes over 16 values; at 2 x 32x32 it normalized over 2
# (1x1 maps), where float32 rounding is amplified ~1e3 (graft and eager then differ by 1e-4..1e-1
# in the loss while agreeing to 1e-10 in float64).
CNN_BATCH, CNN_IMAGE = 4, 64


def _images(seed, size=CNN_IMAGE, batch=CNN_BATCH):
    g = _gen(seed)
    return torch.randn(batch, 3, size, size, generator=g), torch.randint(0, CLASSES, (batch,), generator=g)


def _tokens(seed, low=3):
    # ids 0..2 are left out: they are the special tokens (pad / bos / eos) of several configs.
    return torch.randint(low, VOCAB, (BATCH, SEQ), generator=_gen(seed))


def _no_dropout(model):
    """Every dropout-like probability 0 (torchvision's Dropout and StochasticDepth)."""
    from torchvision.ops import StochasticDepth
    for m in model.modules():
        if isinstance(m, (nn.Dropout, nn.Dropout1d, nn.Dropout2d, nn.Dropout3d, nn.AlphaDropout, StochasticDepth)):
            m.p = 0.0
    return model


def _ce(out, batch):
    return F.cross_entropy(out, batch[-1])


def _hf_loss(out, batch):
    return out.loss


def _vision(model, dropout, make_batch=None):
    if not dropout:
        _no_dropout(model)
    model.train()

    # The labels travel in the batch but not into the module: the loss is computed outside.
    class Images(nn.Module):
        def __init__(self, m):
            super().__init__()
            self.m = m

        def forward(self, x, labels):
            return self.m(x)

    return Zoo(Images(model), make_batch or _images, _ce)


# --- torchvision (Debian's python3-torchvision 0.14) ----------------------------------------------
def resnet18(dropout):
    import torchvision
    return _vision(torchvision.models.resnet18(weights=None, num_classes=CLASSES), dropout)


def mobilenet_v2(dropout):
    import torchvision
    return _vision(torchvision.models.mobilenet_v2(weights=None, num_classes=CLASSES), dropout)


def efficientnet_b0(dropout):
    import torchvision
    return _vision(torchvision.models.efficientnet_b0(weights=None, num_classes=CLASSES), dropout)


def convnext_tiny(dropout):
    import torchvision
    kw = {} if dropout else {"stochastic_depth_prob": 0.0}
    return _vision(torchvision.models.convnext_tiny(weights=None, num_classes=CLASSES, **kw), dropout)


def vit_b_16(dropout):
    import torchvision
    # 32x32 images: 2x2 patches of 16 (+ the class token). The default dropout of vit_b_16 is 0.
    kw = {} if dropout else {"dropout": 0.0, "attention_dropout": 0.0}
    return _vision(torchvision.models.vit_b_16(weights=None, image_size=32, num_classes=CLASSES, **kw), dropout,
                   lambda seed: _images(seed, size=32, batch=BATCH))


# --- recurrent and convolutional text classifiers --------------------------------------------------
class TextClassifier(nn.Module):
    def __init__(self, kind, dropout):
        super().__init__()
        p = 0.1 if dropout else 0.0
        self.kind = kind
        self.emb = nn.Embedding(VOCAB, HIDDEN)
        if kind == "lstm":
            self.body = nn.LSTM(HIDDEN, HIDDEN, num_layers=2, batch_first=True, dropout=p)
        elif kind == "gru":
            self.body = nn.GRU(HIDDEN, HIDDEN, num_layers=2, batch_first=True, dropout=p, bidirectional=True)
        else:
            self.body = nn.Sequential(nn.Conv1d(HIDDEN, HIDDEN, 3, padding=1), nn.ReLU(),
                                      nn.Conv1d(HIDDEN, HIDDEN, 3, padding=1), nn.ReLU())
        width = 2 * HIDDEN if kind == "gru" else HIDDEN
        self.drop = nn.Dropout(p)
        self.head = nn.Linear(width, CLASSES)

    def forward(self, ids, labels):
        h = self.emb(ids)
        if self.kind == "conv1d":
            h = self.body(h.transpose(1, 2)).amax(dim=2)
        else:
            h = self.body(h)[0][:, -1]
        return self.head(self.drop(h))


def _text(kind, dropout):
    def batch(seed):
        ids = _tokens(seed)
        return ids, torch.randint(0, CLASSES, (BATCH,), generator=_gen(seed + 500))
    return Zoo(TextClassifier(kind, dropout).train(), batch, _ce)


def lstm(dropout):
    return _text("lstm", dropout)


def gru(dropout):
    return _text("gru", dropout)


def conv1d(dropout):
    return _text("conv1d", dropout)


# --- Hugging Face transformers 4.36.2 (tiny configs, random weights) -------------------------------
def _hf(model, batch):
    return Zoo(model.train(), batch, _hf_loss)


def _zero(dropout, *names):
    return {} if dropout else {n: 0.0 for n in names}


def _lm_batch(seed):
    ids = _tokens(seed)
    return ids, torch.ones_like(ids), ids.clone()  # input_ids, attention_mask, labels


def _mlm_batch(seed):
    ids = _tokens(seed)
    labels = torch.full_like(ids, -100)
    labels[:, 1::3] = ids[:, 1::3]  # predict every third token
    return ids, torch.ones_like(ids), labels


def _cls_batch(seed):
    ids = _tokens(seed)
    return ids, torch.ones_like(ids), torch.randint(0, CLASSES, (BATCH,), generator=_gen(seed + 500))


class _Keywords(nn.Module):
    """HF models take (input_ids, attention_mask, labels) by keyword: called positionally here."""

    def __init__(self, m, names=("input_ids", "attention_mask", "labels")):
        super().__init__()
        self.m = m
        self.names = names

    def forward(self, *args):
        return self.m(**dict(zip(self.names, args)))


def gpt2(dropout):
    from transformers import GPT2Config, GPT2LMHeadModel
    cfg = GPT2Config(vocab_size=VOCAB, n_positions=2 * SEQ, n_embd=HIDDEN, n_layer=LAYERS, n_head=2,
                     **_zero(dropout, "resid_pdrop", "embd_pdrop", "attn_pdrop"))
    return _hf(_Keywords(GPT2LMHeadModel(cfg)), _lm_batch)


def bert(dropout):
    from transformers import BertConfig, BertForMaskedLM
    cfg = BertConfig(vocab_size=VOCAB, hidden_size=HIDDEN, num_hidden_layers=LAYERS, num_attention_heads=2,
                     intermediate_size=2 * HIDDEN, max_position_embeddings=2 * SEQ,
                     **_zero(dropout, "hidden_dropout_prob", "attention_probs_dropout_prob"))
    return _hf(_Keywords(BertForMaskedLM(cfg)), _mlm_batch)


def roberta(dropout):
    from transformers import RobertaConfig, RobertaForSequenceClassification
    cfg = RobertaConfig(vocab_size=VOCAB, hidden_size=HIDDEN, num_hidden_layers=2, num_attention_heads=2,
                        intermediate_size=2 * HIDDEN, max_position_embeddings=2 * SEQ + 2, num_labels=CLASSES,
                        pad_token_id=1, **_zero(dropout, "hidden_dropout_prob", "attention_probs_dropout_prob"))
    return _hf(_Keywords(RobertaForSequenceClassification(cfg)), _cls_batch)


def distilbert(dropout):
    from transformers import DistilBertConfig, DistilBertForSequenceClassification
    cfg = DistilBertConfig(vocab_size=VOCAB, dim=HIDDEN, n_layers=2, n_heads=2, hidden_dim=2 * HIDDEN,
                           max_position_embeddings=2 * SEQ, num_labels=CLASSES,
                           **_zero(dropout, "dropout", "attention_dropout", "seq_classif_dropout"))
    return _hf(_Keywords(DistilBertForSequenceClassification(cfg)), _cls_batch)


def _seq2seq_batch(seed):
    ids = _tokens(seed)
    return ids, torch.ones_like(ids), _tokens(seed + 500)  # input_ids, attention_mask, labels


def t5(dropout):
    from transformers import T5Config, T5ForConditionalGeneration
    cfg = T5Config(vocab_size=VOCAB, d_model=HIDDEN, d_kv=HIDDEN // 2, d_ff=2 * HIDDEN, num_layers=2,
                   num_decoder_layers=2, num_heads=2, relative_attention_num_buckets=8,
                   relative_attention_max_distance=16, decoder_start_token_id=0, pad_token_id=0,
                   **_zero(dropout, "dropout_rate"))
    return _hf(_Keywords(T5ForConditionalGeneration(cfg)), _seq2seq_batch)


def bart(dropout):
    from transformers import BartConfig, BartForConditionalGeneration
    cfg = BartConfig(vocab_size=VOCAB, d_model=HIDDEN, encoder_layers=2, decoder_layers=2,
                     encoder_attention_heads=2, decoder_attention_heads=2, encoder_ffn_dim=2 * HIDDEN,
                     decoder_ffn_dim=2 * HIDDEN, max_position_embeddings=2 * SEQ, pad_token_id=1,
                     bos_token_id=0, eos_token_id=2, decoder_start_token_id=2,
                     **_zero(dropout, "dropout", "attention_dropout", "activation_dropout", "classifier_dropout"))
    return _hf(_Keywords(BartForConditionalGeneration(cfg)), _seq2seq_batch)


def llama(dropout):
    from transformers import LlamaConfig, LlamaForCausalLM
    # attention_dropout defaults to 0 for Llama; the default-dropout run is the same model.
    cfg = LlamaConfig(vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=2 * HIDDEN, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=2 * SEQ)
    return _hf(_Keywords(LlamaForCausalLM(cfg)), _lm_batch)


def mistral(dropout):
    from transformers import MistralConfig, MistralForCausalLM
    cfg = MistralConfig(vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=2 * HIDDEN, num_hidden_layers=2,
                        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=2 * SEQ,
                        sliding_window=2 * SEQ)
    return _hf(_Keywords(MistralForCausalLM(cfg)), _lm_batch)


def opt(dropout):
    from transformers import OPTConfig, OPTForCausalLM
    cfg = OPTConfig(vocab_size=VOCAB, hidden_size=HIDDEN, num_hidden_layers=2, ffn_dim=2 * HIDDEN,
                    num_attention_heads=2, max_position_embeddings=2 * SEQ, word_embed_proj_dim=HIDDEN,
                    pad_token_id=1, bos_token_id=2, eos_token_id=2,
                    **_zero(dropout, "dropout", "attention_dropout", "layerdrop"))
    return _hf(_Keywords(OPTForCausalLM(cfg)), _lm_batch)


def gpt_neox(dropout):
    from transformers import GPTNeoXConfig, GPTNeoXForCausalLM
    cfg = GPTNeoXConfig(vocab_size=VOCAB, hidden_size=HIDDEN, num_hidden_layers=2, num_attention_heads=2,
                        intermediate_size=2 * HIDDEN, max_position_embeddings=2 * SEQ, rotary_pct=0.5,
                        **_zero(dropout, "hidden_dropout", "attention_dropout"))
    return _hf(_Keywords(GPTNeoXForCausalLM(cfg)), _lm_batch)


def hf_vit(dropout):
    from transformers import ViTConfig, ViTForImageClassification
    cfg = ViTConfig(image_size=IMAGE, patch_size=8, num_channels=3, hidden_size=HIDDEN, num_hidden_layers=2,
                    num_attention_heads=2, intermediate_size=2 * HIDDEN, num_labels=CLASSES,
                    **_zero(dropout, "hidden_dropout_prob", "attention_probs_dropout_prob"))
    return _hf(_Keywords(ViTForImageClassification(cfg), ("pixel_values", "labels")),
               lambda seed: _images(seed, size=IMAGE, batch=BATCH))


class Seq2Seq(nn.Module):
    """nn.Transformer (encoder and decoder) over token embeddings, a padded source (a boolean
    key-padding mask) and a causal target mask, as in PyTorch's translation tutorial."""

    def __init__(self, dropout):
        super().__init__()
        self.emb = nn.Embedding(VOCAB, HIDDEN)
        self.t = nn.Transformer(HIDDEN, 2, num_encoder_layers=2, num_decoder_layers=2, dim_feedforward=2 * HIDDEN,
                                dropout=0.1 if dropout else 0.0, batch_first=True)
        self.head = nn.Linear(HIDDEN, VOCAB)

    def forward(self, src, tgt, src_pad, labels):
        causal = nn.Transformer.generate_square_subsequent_mask(tgt.shape[1])
        y = self.t(self.emb(src), self.emb(tgt), tgt_mask=causal, src_key_padding_mask=src_pad,
                   memory_key_padding_mask=src_pad)
        return self.head(y)


def transformer(dropout):
    def batch(seed):
        src, tgt = _tokens(seed), _tokens(seed + 500)
        pad = torch.zeros(BATCH, SEQ, dtype=torch.bool)
        pad[0, -3:] = True  # the first sequence is 3 tokens shorter
        return src, tgt, pad, _tokens(seed + 700)
    return Zoo(Seq2Seq(dropout).train(), batch, lambda out, b: F.cross_entropy(out.flatten(0, 1), b[-1].flatten()))


def bloom(dropout):
    """BLOOM: its GeLU is a custom autograd.Function (Note [PythonOp], python/graft/_pyfunc.py)."""
    from transformers import BloomConfig, BloomForCausalLM
    cfg = BloomConfig(vocab_size=VOCAB, hidden_size=HIDDEN, n_layer=2, n_head=2,
                      **_zero(dropout, "hidden_dropout", "attention_dropout"))
    return _hf(_Keywords(BloomForCausalLM(cfg)), _lm_batch)


BUILDERS = {
    "resnet18": resnet18, "mobilenet_v2": mobilenet_v2, "efficientnet_b0": efficientnet_b0,
    "convnext_tiny": convnext_tiny, "vit_b_16": vit_b_16,
    "lstm": lstm, "gru": gru, "conv1d": conv1d,
    "gpt2": gpt2, "bert": bert, "roberta": roberta, "distilbert": distilbert, "t5": t5, "bart": bart,
    "llama": llama, "mistral": mistral, "opt": opt, "gpt_neox": gpt_neox, "hf_vit": hf_vit,
    "transformer": transformer, "bloom": bloom,
}
MODELS = list(BUILDERS)

# Models whose batches can carry padding: the pad token id of their config. Their embeddings have
# padding_idx = that id (except T5's), whose row eager PyTorch never updates from the lookup.
PAD_TOKEN = {"bert": 0, "roberta": 1, "distilbert": 0, "t5": 0, "bart": 1, "opt": 1}
SEQ2SEQ = ("t5", "bart")


def padded(name: str, batch: tuple, masked: bool = True, n: int = 2) -> tuple:
    """`batch` (input_ids, attention_mask, labels) with its last `n` positions padding: the pad
    token, label -100 where labels are per token of the input, and attention mask 0 there when
    `masked` (else 1: the pads are attended, as when a caller passes no attention mask)."""
    ids, mask, labels = (t.clone() for t in batch)
    ids[:, -n:] = PAD_TOKEN[name]
    if masked:
        mask[:, -n:] = 0
    if name not in SEQ2SEQ and labels.shape == ids.shape:
        labels[:, -n:] = -100
    return ids, mask, labels


def build(name: str, dropout: bool = False, seed: int = 0) -> Zoo:
    """The model `name` with weights drawn after torch.manual_seed(seed)."""
    torch.manual_seed(seed)
    return BUILDERS[name](dropout)


# --- what eager keeps for backward (tests/python/test_zoo.py, tools/zoo-report) ------------------
def eager_saved(model, batch):
    """What eager autograd saves for backward over one forward of `model`: every tensor packed by
    autograd (torch.autograd.graph.saved_tensors_hooks), counted once per storage, leaving out the
    storages of parameters, buffers and the inputs, which graft's count leaves out too. Returns
    (bytes, {grad_fn name: bytes})."""
    skip = {t.storage().data_ptr() for t in [*model.parameters(), *model.buffers(),
                                              *(b for b in batch if isinstance(b, torch.Tensor))]}
    seen = {}

    def pack(t):
        st = t.storage()
        if st.data_ptr() not in skip:
            seen.setdefault(st.data_ptr(), (st.nbytes(), t.grad_fn.name() if t.grad_fn else "leaf"))
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        model(*batch)
    by = {}
    for b, op in seen.values():
        by[op] = by.get(op, 0) + b
    return sum(by.values()), by


# --- gradient accuracy against float64 (tests/python/test_zoo.py, tools/grad-accuracy) ----------
def float_grads(model, batch, loss_fn, dtype, call=None):
    """Every parameter's gradient (float64 copies; None where there is none) after one forward
    and backward of a copy of `model` in `dtype` on `batch`; `call(module, batch)` wraps and runs
    the copy (GraftModule) where given, else the copy runs eagerly."""
    import copy
    m = copy.deepcopy(model).to(dtype)
    b = tuple(t.to(dtype) if t.is_floating_point() else t for t in batch)
    out = call(m, b) if call else m(*b)
    loss_fn(out, b).backward()
    return [None if p.grad is None else p.grad.double() for p in m.parameters()]


def grad_error(grads, ref):
    """The largest error of `grads` over all parameters, relative to the largest element of `ref`."""
    scale = max(r.abs().max().item() for r in ref if r is not None)
    return max((a - r).abs().max().item() for a, r in zip(grads, ref) if r is not None) / scale


def float64_jitter(model, batch, loss_fn, ref, draws=4, rel=1e-7, enough=float("inf")):
    """How far the exact (float64) gradient itself moves when the floating inputs move by float32's
    rounding (relative noise `rel`): the largest grad_error over `draws` seeded draws. Where a
    model has kinks (ReLU6, max pools) an activation that close to one can change side, and the
    gradient jumps by far more than rounding: no float32 computation can be expected closer to the
    float64 one than this. Stops at the first draw that reaches `enough` (a caller's bound already
    met: each draw is a float64 forward and backward, tens of seconds for a CNN)."""
    worst = 0.0
    for d in range(draws):
        if worst >= enough:
            break
        g = torch.Generator().manual_seed(d)
        noisy = tuple(t.double() * (1 + rel * torch.randn(t.shape, generator=g, dtype=torch.float64))
                      if t.is_floating_point() else t for t in batch)
        worst = max(worst, grad_error(float_grads(model, noisy, loss_fn, torch.float64), ref))
    return worst
