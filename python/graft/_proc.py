"""Reading this process's memory from /proc (Linux): shared by the benchmarks (graft.bench, the
tools) and the export's child process (graft._export), whose protocol is src/cli/bench.cpp's; and
giving back the code pages only the capture used (CodePages, Note [code pages read once])."""
import os
import zlib
from typing import Tuple


def status_bytes(key: str) -> int:
    """A "Key:  123 kB" field of /proc/self/status (VmRSS, VmHWM) in bytes; -1 if absent."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(key + ":"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return -1


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


# Note [code pages read once]
# GraftModule captures the forward in this process (Note [graft's own capture], "Where it runs":
# for modules under 64 MiB of state whose graph may be captured): the forward runs
# once, on PyTorch's kernels, and then never again here, since graft runs the module from then on.
# The code pages it mapped for that (PyTorch's dispatcher and the forward's kernels: 6-8 MiB on the
# zoo's tiny models, more than everything else graft adds) would stay in the process's resident set
# for the whole run. A capture in a forked child loses them when the child exits, but costs copies
# of the parent's pages that Python's reference counts write to (5-7 MiB) while it runs. So the
# capture runs here, and afterwards graft gives back exactly the pages a child would have taken
# with it: the code pages (private read-and-execute file mappings: the shared libraries' and the
# interpreter's code) that were not resident before the capture and are now. madvise(MADV_DONTNEED) on
# a page of a private file mapping that is the file's own page (pagemap bit 61; not a copy written
# to, which would be anonymous) only unmaps it: the page stays in the page cache, and the next access
# maps it again (a minor fault) with the same contents. Other mappings (their read-only constants
# gave back little: 0.1 MiB on gpt2, for 0.4 MiB of bookkeeping), copied pages and mappings that were
# not there before the capture are left alone; where /proc/self/pagemap cannot be read,
# nothing is given back. What this changes is the process's resident set, which is what graft is
# compared with eager on (and what a child's exit would change); the page cache, and a cgroup's
# charge for it, holds those pages either way, as it holds any file a process has read.
#
# After the first step. The same holds for the code a session runs once: graft's importer, shape
# inference, autodiff and planner, the ONNX parser, oneDNN's JIT generator (the kernels it makes
# live in anonymous memory). GraftModule remembers the resident code pages before it builds a
# session and, at that session's second call, gives back those mapped since; the second step maps
# again what a step needs (minor faults, once). GRAFT_CODE_PAGES=keep gives nothing back (for
# comparisons, or where madvise on a library's pages is not wanted): on the B=64 H=256 L=12 stack
# (python3 -m graft.bench, three alternating runs each) GraftModule's steady-state whole process is
# 0.86-0.88x of eager's, 1.005-1.025x with keep.

_MADV_DONTNEED = 4
try:
    _PAGE = os.sysconf("SC_PAGESIZE")
except (AttributeError, ValueError, OSError):
    _PAGE = 4096


def _code_mappings():
    """{"range perms offset device inode": (lo, hi)} of this process's private file mappings of
    code (r-xp)."""
    out = {}
    try:
        with open("/proc/self/maps") as f:
            for line in f:
                p = line.split(None, 5)
                if len(p) == 6 and p[1] == "r-xp" and p[5].startswith("/"):
                    lo, hi = (int(x, 16) for x in p[0].split("-"))
                    out[" ".join(p[:5])] = (lo, hi)
    except OSError:
        return {}
    return out


def _resident(f, lo, hi) -> bytes:
    """One byte per page of [lo, hi): the top byte of its /proc/self/pagemap entry (bit 7: present,
    bit 5: a page of the file, not an anonymous copy of one)."""
    f.seek(lo // _PAGE * 8)
    return f.read((hi - lo) // _PAGE * 8)[7::8]


def new_runs(then: bytes, now: bytes):
    """(first page, pages) of each run of pages resident in `now` as the file's own pages (bits 7
    and 5 of _resident's byte) that were not resident in `then`."""
    start = None
    for i in range(len(now) + 1):
        new = i < len(now) and now[i] & 0xA0 == 0xA0 and not then[i] & 0x80
        if new and start is None:
            start = i
        elif not new and start is not None:
            yield start, i - start
            start = None


class CodePages:
    """Note [code pages read once]: CodePages() remembers which code pages are resident; release()
    unmaps those resident now that were not then, and returns how many bytes that was."""

    def __init__(self):
        self.before = {}
        if os.environ.get("GRAFT_CODE_PAGES") == "keep":  # nothing is given back (an A/B switch)
            return
        # zlib-compressed (runs of resident and absent pages: 6 KiB for 86,000 pages, not 86 KiB:
        # on the zoo's tiny models the bookkeeping would otherwise be a tenth of what it gives back)
        try:
            with open("/proc/self/pagemap", "rb", buffering=0) as f:
                for key, (lo, hi) in _code_mappings().items():
                    self.before[key] = zlib.compress(_resident(f, lo, hi), 1)
        except OSError:
            self.before = {}

    def release(self) -> int:
        if not self.before:
            return 0
        import ctypes
        madvise = ctypes.CDLL(None, use_errno=True).madvise
        madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
        released = 0
        try:
            with open("/proc/self/pagemap", "rb", buffering=0) as f:
                for key, (lo, hi) in _code_mappings().items():
                    then = self.before.get(key)
                    if then is None:
                        continue
                    then, now = zlib.decompress(then), _resident(f, lo, hi)
                    if now == then or len(now) != len(then):
                        continue
                    for start, count in new_runs(then, now):
                        if madvise(lo + start * _PAGE, count * _PAGE, _MADV_DONTNEED) == 0:
                            released += count * _PAGE
        except OSError:
            pass
        self.before = {}
        return released
