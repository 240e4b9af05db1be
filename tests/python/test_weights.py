"""A model built on the meta device, its weights from a .safetensors file or a state_dict, with no
second copy (Note [weights without a copy], python/graft/_weights.py): the same loss and gradients
as the eager model the weights came from; anonymous memory that does not grow by the weights'
size; a state_dict's tensors taken as they are; every mismatch refused before anything is set.

Run with the compiled package on the path:  PYTHONPATH=build/python python3 -m pytest tests/python/test_weights.py
"""
import json
import struct

import pytest
import torch
import torch.nn as nn

import graft
from graft.frontend import GraftModule

_NAMES = {torch.float32: "F32", torch.float64: "F64", torch.int64: "I64", torch.bfloat16: "BF16"}


def save_safetensors(path, tensors):
    """The .safetensors layout written here, independently of graft's reader: a little-endian u64
    header size, the JSON header (dtype, shape, data_offsets), the tensors' bytes back to back."""
    header, blobs, at = {"__metadata__": {"format": "pt"}}, [], 0
    for name, t in tensors.items():
        b = t.detach().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b""
        header[name] = {"dtype": _NAMES[t.dtype], "shape": list(t.shape), "data_offsets": [at, at + len(b)]}
        blobs.append(b)
        at += len(b)
    text = json.dumps(header).encode()
    text += b" " * (-len(text) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(text)) + text + b"".join(blobs))


class Tied(nn.Module):
    """An embedding tied to the output layer, a persistent buffer and a non-persistent one."""

    def __init__(self, vocab=50, d=16):
        super().__init__()
        self.emb = nn.Embedding(vocab, d)
        self.mid = nn.Linear(d, d)
        self.norm = nn.LayerNorm(d)
        self.out = nn.Linear(d, vocab, bias=False)
        self.out.weight = self.emb.weight
        self.register_buffer("shift", torch.linspace(-1, 1, d))
        self.register_buffer("scale", torch.tensor(0.5), persistent=False)

    def forward(self, ids, y):
        h = self.norm(torch.tanh(self.mid(self.emb(ids))) + self.shift) * self.scale
        return nn.functional.cross_entropy(self.out(h).flatten(0, 1), y.flatten())


def batch():
    g = torch.Generator().manual_seed(1)
    return torch.randint(0, 50, (4, 6), generator=g), torch.randint(0, 50, (4, 6), generator=g)


def eager_model():
    torch.manual_seed(0)
    return Tied()


def test_a_meta_model_trains_from_a_safetensors_file_as_eager(tmp_path):
    ref = eager_model()
    path = tmp_path / "w.safetensors"
    save_safetensors(path, ref.state_dict())  # (both names of the tied weight, as state_dict gives them)
    with graft.init_empty_weights():
        m = Tied()
    assert all(p.device.type == "meta" for p in m.parameters())
    assert m.shift.device.type == "cpu" and m.scale.device.type == "cpu"  # buffers stay real
    g = GraftModule(m, weights=str(path))
    assert m.out.weight is m.emb.weight and m.emb.weight.device.type == "cpu"  # still tied
    ids, y = batch()
    for step in range(2):
        loss = g(ids, y)
        loss.backward()
        want = ref(ids, y)
        want.backward()
        torch.testing.assert_close(loss, want)
        for (n, p), q in zip(m.named_parameters(), ref.parameters()):
            torch.testing.assert_close(p.grad, q.grad, msg=lambda s: f"{n}: {s}")
        with torch.no_grad():  # an update writes the weights: copy-on-write, the file unchanged
            for p, q in zip(m.parameters(), ref.parameters()):
                p -= 0.1 * p.grad
                q -= 0.1 * q.grad
                p.grad = q.grad = None
    assert torch.equal(graft.read_safetensors(path)["mid.weight"], eager_model().mid.weight)


def test_reading_matches_the_safetensors_package(tmp_path):
    st = pytest.importorskip("safetensors.torch")
    ts = {"a": torch.randn(3, 5), "b": torch.arange(7), "c": torch.randn(2, 2, dtype=torch.float64),
          "d": torch.randn(4).to(torch.bfloat16), "e": torch.zeros(0, 3)}
    st.save_file(ts, str(tmp_path / "x.safetensors"))
    got = graft.read_safetensors(tmp_path / "x.safetensors")
    assert set(got) == set(ts)
    for k in ts:
        assert got[k].dtype == ts[k].dtype and torch.equal(got[k], ts[k]), k


def rss_anon():
    with open("/proc/self/status") as f:
        return next(int(l.split()[1]) * 1024 for l in f if l.startswith("RssAnon:"))


def test_no_second_copy_of_the_weights(tmp_path):
    """64 MiB of weights from a file: building the model under init_empty_weights, wrapping it and
    running a forward (which reads every weight) grow anonymous memory by less than a quarter of
    the weights (backward then adds the gradients, as in eager); a state_dict's tensors are taken
    as they are (same storage)."""
    def make():
        return nn.Sequential(*[nn.Linear(2048, 2048, bias=False) for _ in range(4)])

    torch.manual_seed(0)
    ref = make()
    path = tmp_path / "big.safetensors"
    save_safetensors(path, ref.state_dict())
    weights_bytes = 4 * 2048 * 2048 * 4
    del ref
    x = torch.randn(2, 2048)
    before = rss_anon()
    with graft.init_empty_weights():
        m = make()
    g = GraftModule(m, weights=path)
    out = g(x).sum()
    grew = rss_anon() - before
    assert grew < weights_bytes / 4, (grew, weights_bytes)
    out.backward()
    assert all(p.grad is not None and p.grad.abs().sum() > 0 for p in m.parameters())
    sd = {k: v.clone() for k, v in graft.read_safetensors(path).items()}
    with graft.init_empty_weights():
        m2 = make()
    GraftModule(m2, weights=sd)
    assert all(p.data_ptr() == sd[n].data_ptr() for n, p in m2.named_parameters())


def test_every_mismatch_is_refused_before_anything_is_set(tmp_path):
    ref = eager_model()
    good = ref.state_dict()

    def fresh():
        with graft.init_empty_weights():
            return Tied()

    cases = [({k: v for k, v in good.items() if k != "mid.bias"}, "mid.bias"),
             (dict(good, extra=torch.zeros(1)), "extra"),
             (dict(good, **{"mid.weight": torch.zeros(3, 3)}), "mid.weight"),
             (dict(good, **{"out.weight": torch.zeros_like(good["out.weight"])}), "tied")]
    for sd, needle in cases:
        m = fresh()
        with pytest.raises(graft.GraftArgumentError, match=needle):
            GraftModule(m, weights=sd)
        assert all(p.device.type == "meta" for p in m.parameters())  # nothing was set
    m = fresh()
    m.scale = torch.empty((), device="meta")  # a non-persistent buffer no checkpoint holds
    with pytest.raises(graft.GraftArgumentError, match="non-persistent"):
        GraftModule(m, weights=good)
    (tmp_path / "bad.safetensors").write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00not json at all!")
    with pytest.raises(graft.GraftInvalidModelError, match="bad.safetensors"):
        GraftModule(fresh(), weights=tmp_path / "bad.safetensors")
    with pytest.raises(graft.GraftIoError, match="missing.safetensors"):
        GraftModule(fresh(), weights=tmp_path / "missing.safetensors")
    with pytest.raises(graft.GraftArgumentError, match="weights="):
        GraftModule(fresh(), weights=42)


def test_a_transformers_llama_built_empty_trains_as_eager(tmp_path):
    tr = pytest.importorskip("transformers")
    cfg = tr.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=16)

    class LM(nn.Module):
        def __init__(self, m):
            super().__init__()
            self.m = m

        def forward(self, ids):
            return self.m(input_ids=ids, labels=ids).loss

    torch.manual_seed(0)
    ref = LM(tr.LlamaForCausalLM(cfg).train())
    path = tmp_path / "llama.safetensors"
    save_safetensors(path, ref.state_dict())
    with graft.init_empty_weights():
        m = LM(tr.LlamaForCausalLM(cfg).train())
    assert all(p.device.type == "meta" for p in m.parameters())
    g = GraftModule(m, weights=path)
    ids = torch.randint(0, 64, (2, 12), generator=torch.Generator().manual_seed(3))
    loss, want = g(ids), ref(ids)
    loss.backward()
    want.backward()
    torch.testing.assert_close(loss, want)
    for (n, p), q in zip(m.named_parameters(), ref.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-4, atol=1e-6, msg=lambda s: f"{n}: {s}")
