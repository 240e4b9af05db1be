"""Anonymous memory of a real-size training loop in one process, step by step: the process's peak
and what it holds after each step, beside graft's own allocator's count (docs/performance.md,
"Real size: ResNet-50's memory is glibc's heap").

    PYTHONPATH=build/python ~/.cache/graft/venv-torch-current/bin/python bench/heap_growth.py graft|eager [STEPS]

ResNet-50, batch 16 x 224^2, AdamW (python/graft/_real.py's model and inputs), 2 threads, 8 steps by
default; GraftModule in step mode. Anonymous memory (resident minus file-backed) is sampled every
~1 ms from a thread, minus the level before the model was built. Run it under
MALLOC_MMAP_THRESHOLD_=65536 to see the same loop with every block of 64 KiB or more mapped and
unmapped by glibc. Timing printed per step is one process's, for orientation only.
"""
import sys
import threading
import time

import torch

from graft import GraftModule, _real


def anon_bytes():
    with open("/proc/self/statm") as f:
        fields = f.read().split()
    return (int(fields[1]) - int(fields[2])) * 4096


def main(argv):
    system = argv[0] if argv else "graft"
    steps = int(argv[1]) if len(argv) > 1 else 8
    torch.set_num_threads(2)
    base = anon_bytes()
    peak, done = [0], threading.Event()

    def sample():
        while not done.is_set():
            peak[0] = max(peak[0], anon_bytes())
            time.sleep(0.001)
    threading.Thread(target=sample, daemon=True).start()
    module, inputs, _, _ = _real.build("resnet50", "real")
    opt = torch.optim.AdamW(module.parameters(), lr=1e-5)
    run = GraftModule(module, gradients="step", optimizer=opt) if system == "graft" else module
    gib = 2.0 ** 30
    for k in range(steps):
        t0 = time.monotonic()
        run(*inputs).backward()
        if system != "graft":
            opt.step()
            opt.zero_grad(set_to_none=True)
        print(f"step {k}: {time.monotonic() - t0:5.2f} s  held after it {(anon_bytes() - base) / gib:.3f} GiB  "
              f"peak so far {(peak[0] - base) / gib:.3f} GiB", flush=True)
    done.set()
    if system == "graft":
        session = run._latest_entry().session
        print(f"graft's allocator: peak {session.memory()['peak'] / gib:.3f} GiB, planned "
              f"{session.planned_peak() / gib:.3f} GiB")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
