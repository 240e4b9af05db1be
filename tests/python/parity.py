"""What the GraftModule tests share: training a module through graft and an eager copy side by
side and comparing everything eager has (tests/python/test_capture.py, test_layers.py)."""
import copy

import torch

from graft.frontend import GraftModule


def close(a, b, what, rtol=1e-4, atol=1e-5):
    assert not (a.is_floating_point() and a.isnan().any() and not b.isnan().any()), f"{what}: NaN"
    assert a.shape == b.shape, f"{what}: shape {tuple(a.shape)} vs eager {tuple(b.shape)}"
    torch.testing.assert_close(a, b, rtol=rtol, atol=atol, msg=lambda m: f"{what}: {m}")


def train_both(model, make_inputs, mode="hook", steps=2, dtype=torch.float32, rtol=1e-3, atol=1e-4, lr=0.1):
    """The model (cast to dtype) in GraftModule(gradients=mode) and an eager copy, `steps` SGD steps (lr)
    on make_inputs(step): the outputs, the loss (the output's dot product with a fixed random tensor,
    or the output itself where it is a scalar), every .grad (None exactly where eager's is), the
    buffers after every step and the parameters at the end compared. A gradient is judged against
    its own scale (one that is 0 in exact arithmetic, as a key bias's, is rounding of either sign).
    Returns the GraftModule."""
    torch.manual_seed(0)
    model = model.to(dtype)
    eager = copy.deepcopy(model)
    g = GraftModule(model, gradients=mode)
    opt_g = torch.optim.SGD(model.parameters(), lr=lr)
    opt_e = torch.optim.SGD(eager.parameters(), lr=lr)
    for step in range(steps):
        args = make_inputs(step)
        for o in (opt_g, opt_e):
            o.zero_grad(set_to_none=True)
        yg = g(*args)
        ye = eager(*[a.detach().clone().requires_grad_(a.requires_grad) if isinstance(a, torch.Tensor) else a
                     for a in args])
        close(yg.detach(), ye.detach(), f"step {step} output", rtol, atol)
        w = torch.randn(ye.shape, generator=torch.Generator().manual_seed(step), dtype=ye.dtype)
        lg, le = (yg, ye) if ye.dim() == 0 else ((yg * w).sum(), (ye * w).sum())
        close(lg.detach(), le.detach(), f"step {step} loss", rtol, atol)
        lg.backward()
        le.backward()
        for (n, p), q in zip(model.named_parameters(), eager.parameters()):
            assert (p.grad is None) == (q.grad is None), f"step {step}: {n}.grad presence differs"
            if q.grad is not None:
                close(p.grad, q.grad, f"step {step}: {n}.grad", rtol, max(atol, rtol * q.grad.abs().max().item()))
        opt_g.step()
        opt_e.step()
        for (n, b), c in zip(model.named_buffers(), eager.buffers()):
            close(b, c, f"step {step}: buffer {n}", rtol, atol)
    for (n, p), q in zip(model.named_parameters(), eager.parameters()):
        close(p.detach(), q.detach(), f"parameter {n}", rtol, max(atol, rtol * q.abs().max().item()))
    return g
