"""Give freed heap memory back to the OS: while a model is being built, and after big passes.

(Mapping every allocation of 256 KiB or more on its own, glibc's M_MMAP_THRESHOLD, lowered the
peak RSS of a 512-token prefill 447 -> 430 MB but cost 24% of its speed in page faults: not done.)
"""
from __future__ import annotations

import ctypes

__all__ = ["release_freed_memory"]


def release_freed_memory() -> None:
    """Hand the heap pages freed so far back to the OS (glibc malloc_trim); no-op elsewhere.

    Building the model frees the loader's tensors piece by piece while packed copies are made;
    glibc would keep those pages mapped, so RSS would stay at (and peak above) the build's high
    water mark. Calling this between layers keeps the peak near the final size.
    """
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass

