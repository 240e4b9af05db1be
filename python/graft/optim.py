"""graft.optim.AdamW: torch.optim.AdamW's update with its moments in a file on local disk.

    opt = graft.optim.AdamW(model.parameters(), lr=1e-4, state_file="/nvme/adamw.state")
    model = graft.GraftModule(model, gradients="step", optimizer=opt)   # or eager: opt.step()

AdamW keeps two moments per weight: with float32 weights, 8 of the 12 bytes per parameter that the
step inside backward needs. This optimizer keeps them in `state_file` instead, and RAM holds a
window of them (`state_window` bytes; 0: one unit, at most 32 MiB of each moment, plus 512 MiB
or the whole state when smaller). The state moves in those units, read ahead of its update in the
order updates came the step before and written back behind it, bypassing the page cache (Note
[optimizer state on disk], src/train/state_file.cpp). The update is graft's C++ AdamW (PyTorch
1.13's single-tensor formula) on the same bytes.

It is a torch.optim.Optimizer: param groups, learning-rate schedulers, zero_grad, state_dict and
load_state_dict work as for torch.optim.AdamW, without a copy of the moments in RAM: state_dict's
moments are read-only memory-mapped views of the file, and load_state_dict writes them into it one
parameter at a time, so `torch.save(opt.state_dict(), f)` and
`opt.load_state_dict(torch.load(f, mmap=True))` checkpoint a state larger than RAM. Parameters:
float32 or float64, contiguous, on the CPU. `stats()` reports the file's traffic. The file is
created (or truncated) at construction, with its whole size reserved: a disk that cannot hold it
raises graft.GraftIoError naming the path.
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
        """torch.optim.AdamW's layout: per parameter step, exp_avg and exp_avg_sq. The moments are
        views of the state file, memory-mapped copy-on-write: the page cache holds what is read,
        not this process's anonymous memory, so torch.save streams them into a checkpoint without
        a copy of the state in RAM (copy.deepcopy or .clone() makes one). Writing into one changes
        that view alone, never the file."""
        offsets = self._file.offsets()  # (every write in flight done first)
        steps = self._file.steps()
        saved = {}
        for p, off, n in zip(self._params, offsets, steps):
            saved[p] = self.state.get(p)
            if n:
                m, v = self._views(p, off)
                self.state[p] = {"step": torch.tensor(float(n)), "exp_avg": m, "exp_avg_sq": v}
        try:
            return super().state_dict()
        finally:
            for p, s in saved.items():
                if s is None:
                    self.state.pop(p, None)
                else:
                    self.state[p] = s

    def _views(self, p, offset):
        """exp_avg and exp_avg_sq of p: copy-on-write maps of the state file at offset = (where,
        stride) (one mapping per tensor, so none is larger than RAM)."""
        from ._weights import mapped
        count = p.numel()
        if count == 0:
            return torch.zeros_like(p), torch.zeros_like(p)
        at, stride = offset
        with open(self.state_file, "rb") as f:
            m, v = (mapped(f.fileno(), at + j * stride, p.dtype, count) for j in (0, 1))
        return m.view(p.shape), v.view(p.shape)

    def load_state_dict(self, state_dict):
        """torch.optim.AdamW's state_dict (its own, or this optimizer's). The moments go into the
        file one parameter at a time (RAM: one parameter's state), never all at once: with
        torch.load(..., mmap=True) no copy of the whole state is made. torch's own
        load_state_dict sees the steps alone (torch 1.13's deep-copies what it is given)."""
        from .errors import GraftArgumentError
        moments = {k: v for k, v in state_dict["state"].items()}
        light = dict(state_dict)
        light["state"] = {k: {"step": v["step"]} for k, v in moments.items() if "step" in v}
        super().load_state_dict(light)
        ids = [i for g in state_dict["param_groups"] for i in g["params"]]
        per = []
        keep = []  # the converted tensors, alive until the file has them
        for p, key in zip(self._params, ids):
            st = moments.get(key, {})
            if "exp_avg" in st:
                m, v = st["exp_avg"], st["exp_avg_sq"]
                if m.shape != p.shape or v.shape != p.shape:
                    raise GraftArgumentError(
                        f"graft.optim.AdamW.load_state_dict: the state of parameter {key} is "
                        f"{tuple(m.shape)} / {tuple(v.shape)}, the parameter {tuple(p.shape)}", "invalid argument")
                m = m.to(p.dtype).contiguous()
                v = v.to(p.dtype).contiguous()
                keep.append((m, v))
                per.append((m.data_ptr(), v.data_ptr(), int(st["step"])))
            else:
                per.append((0, 0, 0))
        self._file.load_state(per)
        for p, (_, _, n) in zip(self._params, per):  # the moments live in the file, not here
            if n:
                self.state[p] = {"step": n}
            else:
                self.state.pop(p, None)
