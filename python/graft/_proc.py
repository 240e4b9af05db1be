"""Reading memory from /proc (Linux): this process's, for the benchmarks (graft.bench, the tools)
and the export's child process (graft._export), and a child's anonymous memory sampled from the
parent (AnonSampler; the protocol src/cli/bench.cpp follows too)."""
import os
import subprocess
import threading
import time
from typing import Tuple


def _kb_field(path: str, key: str, missing: int) -> int:
    """A "Key:  123 kB" line of a /proc file, in bytes; `missing` if absent or unreadable."""
    try:
        with open(path) as f:
            for line in f:
                if line.startswith(key + ":"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return missing


def status_bytes(key: str) -> int:
    """A field of /proc/self/status (VmRSS, VmHWM) in bytes; -1 if absent."""
    return _kb_field("/proc/self/status", key, -1)


def meminfo_bytes(key: str) -> int:
    """A field of /proc/meminfo (MemAvailable) in bytes; 0 if absent."""
    return _kb_field("/proc/meminfo", key, 0)


def reset_peak() -> bool:
    """VmHWM := VmRSS (Linux >= 4.0); False where the kernel does not allow it."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def private_bytes() -> Tuple[int, int]:
    """(private bytes, RSS bytes) of this process from /proc/self/smaps_rollup; (0, 0) without it."""
    got = {}
    try:
        with open("/proc/self/smaps_rollup") as f:
            for line in f:
                parts = line.split()
                if len(parts) == 3 and parts[2] == "kB":
                    got[parts[0].rstrip(":")] = int(parts[1]) * 1024
    except OSError:
        return 0, 0
    return got.get("Private_Clean", 0) + got.get("Private_Dirty", 0), got.get("Rss", 0)


# --- anonymous memory, sampled from the parent (../shared/DESIGN.md: what can run a machine out of
# memory is anonymous memory, resident minus file-backed and shared pages; code pages count for no
# system). The kernel keeps no high-water mark of it, so the benchmarks' parent samples each child's
# /proc/PID/statm at about SAMPLE_HZ, the same way for every system; the child reports, in
# CLOCK_MONOTONIC seconds (Python's time.monotonic, C++'s steady_clock), when each step began and
# ended and its own exact readings at those moments, and the parent takes the peak per window.
SAMPLE_HZ = 1000


def _page_size() -> int:
    try:
        return os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError):
        return 4096


PAGE_SIZE = _page_size()


def anon_bytes(pid="self") -> int:
    """Resident minus shared (file-backed + shmem) bytes of a process, from /proc/PID/statm; -1 if
    it cannot be read (the process is gone, or no /proc)."""
    try:
        with open(f"/proc/{pid}/statm", "rb") as f:
            fields = f.read().split()
        return (int(fields[1]) - int(fields[2])) * PAGE_SIZE
    except (OSError, ValueError, IndexError):
        return -1


class StepMarks:
    """The child's side: when the model was about to be created and when each step began and
    ended (monotonic seconds), with the anonymous bytes read at those moments. to_json() goes into
    the child's row; the parent adds the sampled peaks (summarize_anon)."""

    def __init__(self):
        self.before_model = (time.monotonic(), anon_bytes())
        self.steps = []  # (t0, anon at t0, t1, anon at t1)
        self._open = None

    def start(self):
        self._open = (time.monotonic(), anon_bytes())

    def end(self):
        t0, a0 = self._open
        self.steps.append((t0, a0, time.monotonic(), anon_bytes()))

    def to_json(self, warmup: int) -> dict:
        return {"anon_before_model_bytes": self.before_model[1], "warmup_steps_marked": warmup,
                "step_windows": [[s[0], s[2]] for s in self.steps],
                "anon_at_step_start_bytes": [s[1] for s in self.steps],
                "anon_at_step_end_bytes": [s[3] for s in self.steps]}


class AnonSampler:
    """Samples /proc/PID/statm of one process at about SAMPLE_HZ on a thread of this (the parent)
    process until the process is gone or stop() is called; samples: [(monotonic seconds, bytes)]."""

    def __init__(self, pid: int, hz: int = SAMPLE_HZ):
        self.samples = []
        self._period = 1.0 / hz
        self._stop = threading.Event()
        try:
            self._fd = os.open(f"/proc/{pid}/statm", os.O_RDONLY)
        except OSError:
            self._fd = -1
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self):
        fd, out, period = self._fd, self.samples, self._period
        while fd >= 0 and not self._stop.is_set():
            try:
                fields = os.pread(fd, 128, 0).split()
                out.append((time.monotonic(), (int(fields[1]) - int(fields[2])) * PAGE_SIZE))
            except (OSError, ValueError, IndexError):
                break  # the process has exited
            time.sleep(period)

    def stop(self):
        self._stop.set()
        self._thread.join()
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1
        return self.samples


def run_sampled(cmd, env=None, timeout=None):
    """Runs cmd (text output captured) with its anonymous memory sampled; returns
    (returncode, stdout, stderr, samples). Raises subprocess.TimeoutExpired (the child killed) and
    OSError as subprocess.run does."""
    p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    sampler = AnonSampler(p.pid)
    try:
        out, err = p.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        p.kill()
        p.communicate()
        sampler.stop()
        raise
    return p.returncode, out, err, sampler.stop()


def _peak_in(samples, t0, t1, *exact):
    got = [b for t, b in samples if t0 <= t <= t1 and b >= 0] + [b for b in exact if b is not None and b >= 0]
    return max(got) if got else None


def summarize_anon(row: dict, samples) -> dict:
    """Adds to a child's row (which carries StepMarks.to_json's fields, or graft bench's same ones)
    the sampled anonymous-memory peaks:
      peak_anon_delta_bytes_per_step / peak_anon_delta_bytes: per timed step, peak during it minus
        the bytes at its start (max over steps);
      peak_anon_bytes: peak during the timed steps minus the bytes before the model was created;
      peak_anon_bytes_first_call: the same over every step, the warm-up (first call) included;
      anon_samples: samples taken during the timed steps.
    Leaves the row alone if it has no step windows (an older child, or a failed one)."""
    windows = row.get("step_windows")
    if not windows:
        return row
    warm = int(row.get("warmup_steps_marked", 0))
    starts, ends = row["anon_at_step_start_bytes"], row["anon_at_step_end_bytes"]
    base = row.get("anon_before_model_bytes", -1)
    deltas, peaks = [], []
    for k, (t0, t1) in enumerate(windows):
        peak = _peak_in(samples, t0, t1, starts[k], ends[k])
        peaks.append(peak)
        if k >= warm:
            deltas.append(peak - starts[k] if peak is not None and starts[k] >= 0 else -1)
    timed = [p for p in peaks[warm:] if p is not None]
    every = [p for p in peaks if p is not None]
    row["peak_anon_delta_bytes_per_step"] = deltas
    row["peak_anon_delta_bytes"] = max(deltas) if deltas else -1
    row["peak_anon_bytes"] = max(timed) - base if timed and base >= 0 else -1
    row["peak_anon_bytes_first_call"] = max(every) - base if every and base >= 0 else -1
    row["anon_samples"] = sum(1 for t, _ in samples if windows[warm][0] <= t <= windows[-1][1]) if len(windows) > warm else 0
    row["anon_sample_hz"] = SAMPLE_HZ
    return row
