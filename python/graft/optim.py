"""graft.optim.AdamW: torch.optim.AdamW's update with its moments in a file on local disk.

    opt = graft.optim.AdamW(model.parameters(), lr=1e-4, state_file="/nvme/adamw.state")
    model = graft.GraftModule(model, gradients="step", optimizer=opt)   # or eager: opt.step()

AdamW keeps two moments per weight: with float32 weights, 8 of the 12 bytes per parameter that the
step inside backward needs. This optimizer keeps them in `state_file` instead, and RAM holds a
window of them (`state_window` bytes; 0: four of the largest parameter's state). Each parameter's
state is read ahead of its update in the order updates came the step before, and written back
behind it, bypassing the page cache (Note [optimizer state on disk], src/train/state_file.cpp).
The update is graft's C++ AdamW (PyTorch 1.13's single-tensor formula) on the same bytes.

It is a torch.optim.Optimizer: param groups, learning-rate schedulers, zero_grad, state_dict and
load_state_dict work as for torch.optim.AdamW (state_dict reads the moments back from the file:
that much RAM, for a checkpoint). Parameters: float32 or float64, contiguous, on the CPU.
`stats()` reports the file's traffic. The file is created (or truncated) at construction, with its
whole size reserved: a disk that cannot hold it raises graft.GraftIoError naming the path.
"""
import torch

_DTYPES = {torch.float32: "float32", torch.float64: "float64"}


class AdamW(torch.optim.Optimizer):
    def __init__(self, params, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=1e-2, *,
                 state_file, state_window=0, direct_io=True):
        from . import _graft
        from .errors import GraftArgumentError
        if not state_file:
            raise GraftArgumentError("graft.optim.AdamW needs state_file= (a path on local disk); for the "
                                     "moments in RAM use torch.optim.AdamW", "invalid argument")
        super().__init__(params, dict(lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay))
        self._params = [p for g in self.param_groups for p in g["params"]]
        for p in self._params:
            if p.dtype not in _DTYPES or p.device.type != "cpu" or not p.is_contiguous():
                raise GraftArgumentError(
                    f"graft.optim.AdamW updates contiguous float32 / float64 CPU parameters; one is "
                    f"{p.dtype} on {p.device}{'' if p.is_contiguous() else ', not contiguous'}", "invalid argument")
        self._index = {id(p): i for i, p in enumerate(self._params)}
        self._file = _graft.AdamWFile([list(p.shape) for p in self._params],
                                      [_DTYPES[p.dtype] for p in self._params], str(state_file),
                                      int(state_window), bool(direct_io))
        self.state_file = str(state_file)

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            b1, b2 = group["betas"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                g = p.grad
                if g.dtype != p.dtype or not g.is_contiguous():
                    g = g.to(p.dtype).contiguous()
                self._file.update(self._index[id(p)], p.data_ptr(), g.data_ptr(), float(group["lr"]),
                                  float(b1), float(b2), float(group["eps"]), float(group["weight_decay"]))
                self.state[p]["step"] = self.state[p].get("step", 0) + 1
        return loss

    def stats(self):
        """The state file's traffic: path, direct_io, file_bytes, window_bytes, bytes_read,
        bytes_written, prefetch_hits (updates that found their state already read), ram_bytes
        (what the optimizer holds in RAM now)."""
        return self._file.stats()

    def state_dict(self):
        """torch.optim.AdamW's layout: per parameter step, exp_avg and exp_avg_sq (read from the file)."""
        moments = [(torch.zeros_like(p), torch.zeros_like(p)) for p in self._params]
        steps = self._file.read_states([(m.data_ptr(), v.data_ptr()) for m, v in moments])
        saved = {}
        for p, (m, v), n in zip(self._params, moments, steps):
            saved[p] = self.state.get(p)
            if n:
                self.state[p] = {"step": torch.tensor(float(n)), "exp_avg": m, "exp_avg_sq": v}
        try:
            return super().state_dict()
        finally:
            for p, s in saved.items():
                if s is None:
                    self.state.pop(p, None)
                else:
                    self.state[p] = s

    def load_state_dict(self, state_dict):
        super().load_state_dict(state_dict)
        per = []
        for p in self._params:
            st = self.state.get(p, {})
            if "exp_avg" in st:
                m = st["exp_avg"].to(p.dtype).contiguous()
                v = st["exp_avg_sq"].to(p.dtype).contiguous()
                n = int(st["step"])
                per.append((m, v, n))
            else:
                per.append((None, None, 0))
        self._file.load_state([(m.data_ptr() if m is not None else 0, v.data_ptr() if v is not None else 0, n)
                               for m, v, n in per])
        for p, (_, _, n) in zip(self._params, per):  # the moments live in the file, not here
            if n:
                self.state[p] = {"step": n}
            else:
                self.state.pop(p, None)
