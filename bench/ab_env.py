"""A/B of a GRAFT_* switch that graft reads when a graph is compiled (GRAFT_ATTENTION_VIEWS,
GRAFT_BLOCKED, GRAFT_BF16_OPERANDS, ...), on one model of `python3 -m graft.bench --real`, in one
process: a GraftModule built under each setting (the switch set while its first call compiles),
then their steps alternated, so both see the same machine state.

    PYTHONPATH=build/python ~/.cache/graft/venv-torch-current/bin/python bench/ab_env.py \
        MODEL NAME=VALUE [--rounds 3] [--threads 2] [--precision fp32|bf16]

Prints each setting's first loss (the two must agree to rounding) and step times (forward +
backward, GraftModule(gradients="step", AdamW)), and the ratio of the best steps (B / A: A is the
environment as it is, B with NAME=VALUE).
"""
import argparse
import os
import sys
import time


def main(argv):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("model")
    p.add_argument("setting", help="NAME=VALUE, e.g. GRAFT_ATTENTION_VIEWS=0")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--precision", choices=("fp32", "bf16"), default="fp32")
    a = p.parse_args(argv)
    name, sep, value = a.setting.partition("=")
    if not sep or not name.startswith("GRAFT_"):
        p.error(f"{a.setting!r} is not GRAFT_NAME=VALUE")
    import torch
    import graft
    from graft import _real
    torch.set_num_threads(a.threads)
    before = os.environ.get(name)
    runs = {}
    for label, v in (("A", before), ("B", value)):
        if v is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = v
        module, inputs, _, _ = _real.build(a.model, "real")
        g = graft.GraftModule(module, gradients="step", precision=a.precision,
                              optimizer=torch.optim.AdamW(module.parameters(), lr=1e-5))
        loss = g(*inputs)
        loss.backward()  # compiled under this setting
        runs[label] = (g, inputs, loss.item(), [])
    if before is None:
        os.environ.pop(name, None)
    else:
        os.environ[name] = before
    for _ in range(a.rounds):
        for label in ("A", "B"):
            g, inputs, _, times = runs[label]
            t0 = time.monotonic()
            g(*inputs).backward()
            times.append(time.monotonic() - t0)
    for label in ("A", "B"):
        _, _, loss, times = runs[label]
        setting = f"{name}={value}" if label == "B" else f"{name}={before}" if before else f"{name} unset"
        print(f"{a.model} {label} ({setting}): first loss {loss:.6f}, steps "
              f"{', '.join(f'{t:.3f}' for t in times)} s, best {min(times):.3f} s")
    print(f"{a.model} best step B / A: {min(runs['B'][3]) / min(runs['A'][3]):.3f}")


if __name__ == "__main__":
    main(sys.argv[1:])
