"""graft.optim.AdamW (python/graft/optim.py): AdamW with its moments in a file on disk (Note
[optimizer state on disk]), against torch.optim.AdamW, eagerly and inside GraftModule's step mode;
its state_dict round trip, and a checkpoint through torch.save that holds no copy of the moments in
RAM; what it keeps in RAM; a path it cannot use.

Run with the compiled package on the path:  PYTHONPATH=build/python python3 -m pytest tests/python/test_optim.py
"""
import copy
import os

import pytest
import torch
import torch.nn as nn

import graft
from graft.frontend import GraftModule
from graft.optim import AdamW

HP = dict(lr=1e-2, betas=(0.9, 0.99), eps=1e-8, weight_decay=0.05)


def model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 64), nn.GELU(), nn.Linear(64, 64), nn.Tanh(), nn.Linear(64, 4))


def batch(k):
    g = torch.Generator().manual_seed(k)
    return torch.randn(32, 16, generator=g), torch.randn(32, 4, generator=g)


def torch_adamw(m):
    kw = {"foreach": False} if "foreach" in torch.optim.AdamW.__init__.__code__.co_varnames else {}
    return torch.optim.AdamW(m.parameters(), **HP, **kw)


def train_eager(m, opt, steps, start=0, schedule=False):
    sched = torch.optim.lr_scheduler.StepLR(opt, 2, 0.5) if schedule else None
    for k in range(start, start + steps):
        x, y = batch(k)
        opt.zero_grad()
        ((m(x) - y) ** 2).mean().backward()
        opt.step()
        if sched:
            sched.step()


def close(a, b):
    for (n, p), q in zip(a.named_parameters(), b.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6, msg=lambda s: f"{n}: {s}")


@pytest.mark.parametrize("schedule", [False, True])
def test_eager_training_matches_torch_adamw(tmp_path, schedule):
    ref, mine = model(), model()
    train_eager(ref, torch_adamw(ref), 6, schedule=schedule)
    opt = AdamW(mine.parameters(), **HP, state_file=tmp_path / "s.bin")
    train_eager(mine, opt, 6, schedule=schedule)
    close(mine, ref)
    st = opt.stats()
    n = sum(p.numel() for p in mine.parameters())
    assert st["bytes_written"] == 6 * 8 * n and st["bytes_read"] >= 5 * 8 * n
    assert all(set(opt.state[p]) == {"step"} for p in mine.parameters())  # no moment in RAM here


def test_step_mode_in_graftmodule_matches_eager_torch_adamw(tmp_path):
    ref, mine = model(), model()
    train_eager(ref, torch_adamw(ref), 5)
    opt = AdamW(mine.parameters(), **HP, state_file=tmp_path / "s.bin")
    g = GraftModule(mine, gradients="step", optimizer=opt)
    for k in range(5):
        x, y = batch(k)
        ((g(x) - y) ** 2).mean().backward()
    close(mine, ref)
    assert all(p.grad is None for p in mine.parameters())
    assert opt.stats()["prefetch_hits"] > 0


def test_state_dict_round_trip_resumes_exactly(tmp_path):
    ref = model()
    opt_ref = AdamW(ref.parameters(), **HP, state_file=tmp_path / "ref.bin")
    train_eager(ref, opt_ref, 6)
    mine = model()
    opt = AdamW(mine.parameters(), **HP, state_file=tmp_path / "a.bin")
    train_eager(mine, opt, 3)
    sd = copy.deepcopy(opt.state_dict())
    assert set(sd["state"][0]) == {"step", "exp_avg", "exp_avg_sq"}
    # torch.optim.AdamW reads it too
    t = torch_adamw(copy.deepcopy(mine))
    t.load_state_dict(sd)
    opt2 = AdamW(mine.parameters(), **HP, state_file=tmp_path / "b.bin")
    opt2.load_state_dict(sd)
    train_eager(mine, opt2, 3, start=3)
    for p, q in zip(mine.parameters(), ref.parameters()):
        assert torch.equal(p, q)


def rss_anon():
    with open("/proc/self/status") as f:
        return next(int(l.split()[1]) * 1024 for l in f if l.startswith("RssAnon:"))


def held():
    """Anonymous memory less the freed blocks graft keeps for reuse (Note [mapped block cache]:
    never more than the most graft ever had in use at once, which the test also checks)."""
    s = graft.memory_cache_stats()
    assert s["in_use"] + s["kept"] <= s["high"], s
    return rss_anon() - s["kept"]


def test_a_checkpoint_through_torch_save_holds_no_copy_of_the_moments(tmp_path):
    """torch.save(opt.state_dict()) and opt.load_state_dict(torch.load(..., mmap=True)) over 64 MiB
    of moments: the process's anonymous memory (less graft's kept blocks) grows by less than a
    quarter of them either way
    (state_dict's moments are views of the file; load_state_dict copies one parameter at a time),
    and training resumed from the checkpoint is bit-identical to training straight through."""
    def big():
        torch.manual_seed(0)
        return nn.Sequential(nn.Linear(2048, 2048, bias=False), nn.Linear(2048, 2048, bias=False))

    def train(m, opt, steps, start=0):
        for k in range(start, start + steps):
            x = torch.randn(8, 2048, generator=torch.Generator().manual_seed(k))
            opt.zero_grad()
            (m(x) ** 2).mean().backward()
            opt.step()

    moments = 2 * 2 * 2048 * 2048 * 4
    ref = big()
    train(ref, AdamW(ref.parameters(), **HP, state_file=tmp_path / "ref.bin"), 4)
    mine = big()
    opt = AdamW(mine.parameters(), **HP, state_file=tmp_path / "a.bin")
    train(mine, opt, 2)
    opt.zero_grad(set_to_none=True)
    opt.stats()  # the reads ahead for the next step (the window) are done and counted before
    ck = tmp_path / "opt.pt"
    before = held()
    sd = opt.state_dict()
    assert set(sd["state"][0]) == {"step", "exp_avg", "exp_avg_sq"}
    torch.save(sd, ck)
    grew = held() - before
    assert grew < moments / 4, (grew, moments)
    was = sd["state"][0]["exp_avg"].clone()
    sd["state"][0]["exp_avg"].add_(1)  # a private copy of those pages: the file is unchanged
    assert torch.equal(opt.state_dict()["state"][0]["exp_avg"], was)
    del sd
    opt2 = AdamW(mine.parameters(), **HP, state_file=tmp_path / "b.bin")
    mmap = {"mmap": True} if "mmap" in torch.load.__code__.co_varnames else {}
    before = held()
    loaded = torch.load(ck, **mmap)
    opt2.load_state_dict(loaded)
    del loaded
    if mmap:  # (torch 1.13 has no mmap=True: torch.load itself reads the file into RAM)
        grew = held() - before
        assert grew < moments / 4, (grew, moments)
    train(mine, opt2, 2, start=2)
    for p, q in zip(mine.parameters(), ref.parameters()):
        assert torch.equal(p, q)


def test_a_path_it_cannot_use_is_an_error_naming_it(tmp_path):
    bad = tmp_path / "missing-dir" / "s.bin"
    with pytest.raises(graft.GraftIoError, match="missing-dir"):
        AdamW(model().parameters(), state_file=bad)
    with pytest.raises(graft.GraftArgumentError):
        AdamW(model().half().parameters(), state_file=tmp_path / "h.bin")


@pytest.mark.skipif(os.environ.get("GRAFT_BLOCK_REUSE") == "0" or "MALLOC_MMAP_THRESHOLD_" in os.environ,
                    reason="the block cache is off, or trims after every run (memory policy)")
def test_empty_cache_gives_the_kept_blocks_back():
    """Note [mapped block cache]: after steps, graft keeps freed blocks of 1 MiB and more for the next
    step (never more, kept and in use, than its peak in use); graft.empty_cache() unmaps them."""
    torch.manual_seed(0)
    g = GraftModule(nn.Sequential(nn.Linear(1024, 1024), nn.ReLU(), nn.Linear(1024, 1024)))
    x = torch.randn(512, 1024)  # 2 MiB activations
    for _ in range(2):
        g(x).sum().backward()
    s = graft.memory_cache_stats()
    assert s["kept"] >= 2 << 20 and s["in_use"] + s["kept"] <= s["high"], s
    assert s["hits"] + s["splits"] > 0, s  # the second step reused the first's pages
    before = rss_anon()
    graft.empty_cache()
    after = graft.memory_cache_stats()
    assert after["kept"] == 0 and after["high"] == after["in_use"], after
    assert before - rss_anon() >= 0.9 * s["kept"], (before, rss_anon(), s)
