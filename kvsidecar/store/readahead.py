"""Reading a file ahead of its use: advice to the kernel (POSIX_FADV_WILLNEED), in steps it honours.

Linux reads at most one read-ahead window per WILLNEED call, whatever range is asked for: the larger of the
device's `read_ahead_kb` and `max_sectors_kb` (8 MiB on this project's test VM, often 128 KiB). So a whole
file is advised one window at a time; each call only submits the reads, and the page cache fills behind.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Callable
from pathlib import Path

DEFAULT_STEP = 128 * 1024  # the kernel's default read-ahead window
MAX_STEP = 64 * 1024 * 1024


@functools.lru_cache(maxsize=64)
def step_bytes(dev: int) -> int:
    """The largest range one WILLNEED call reads on the block device behind `dev` (a file's st_dev)."""
    try:
        device = Path(f"/sys/dev/block/{os.major(dev)}:{os.minor(dev)}").resolve()
        queue = device.parent / "queue" if (device / "partition").exists() else device / "queue"
        kb = max(int((queue / q).read_text()) for q in ("read_ahead_kb", "max_sectors_kb"))
    except (OSError, ValueError):  # no block device behind it (tmpfs, overlay, NFS): the default
        return DEFAULT_STEP
    return max(DEFAULT_STEP, min(MAX_STEP, kb * 1024))


def read_ahead(fd: int, size: int, step: int, *, stop: Callable[[], bool]) -> int:
    """Advise `size` bytes of `fd` one `step` at a time until done or `stop()`; returns the bytes advised.
    Nothing is read into this process: the kernel fills its page cache."""
    advise = getattr(os, "posix_fadvise", None)
    if advise is None:
        return 0
    done = 0
    while done < size and not stop():
        advise(fd, done, step, os.POSIX_FADV_WILLNEED)
        done += step
    return min(done, size)
