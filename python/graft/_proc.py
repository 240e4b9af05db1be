"""Reading this process's memory from /proc (Linux): shared by the benchmarks (graft.bench, the
tools) and the export's child process (graft._export), whose protocol is src/cli/bench.cpp's."""
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
