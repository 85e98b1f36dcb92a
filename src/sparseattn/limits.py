"""Memory estimates checked before large allocations.

An input too large for the machine (a 2000×2000×2000 latent, a billion heads, a dense selection of a
huge layout) is refused at once, with the estimated size in the message, instead of failing with a
``MemoryError`` after seconds of work. Estimates are rough upper bounds of the peak memory; the limit
is half the physical memory, or ``SPARSEATTN_MEMORY_LIMIT`` (bytes, or a number with a K/M/G/T
suffix, e.g. ``64G``).
"""

from __future__ import annotations

import os

#: Peak bytes per token while building a video or partition layout (index temporaries included).
LAYOUT_BYTES_PER_TOKEN = 160
#: Bytes per token and head while scoring blocks from Q/K features (factors and their temporaries).
FEATURE_BYTES_PER_TOKEN = 192
#: Peak bytes per selected block pair of a graph being built and analysed.
GRAPH_BYTES_PER_PAIR = 64
#: Bytes of results kept per head (counts of every route, block-fill histograms).
RESULT_BYTES_PER_HEAD = 256

_SUFFIXES = {"": 1, "K": 2**10, "M": 2**20, "G": 2**30, "T": 2**40}


def memory_limit() -> int:
    """Bytes one build or analysis may use (see the module docstring)."""
    text = os.environ.get("SPARSEATTN_MEMORY_LIMIT", "").strip().upper().removesuffix("B")
    if text:
        try:
            return int(float(text[:-1] if text[-1:] in _SUFFIXES else text) * _SUFFIXES.get(text[-1:], 1))
        except ValueError:
            raise ValueError(
                "SPARSEATTN_MEMORY_LIMIT must be bytes or a number with a K/M/G/T suffix (e.g. 64G), got "
                f"{os.environ['SPARSEATTN_MEMORY_LIMIT']!r}"
            ) from None
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") // 2
    except (AttributeError, ValueError, OSError):
        return 8 * 2**30


def format_bytes(nbytes: float) -> str:
    if nbytes >= 2**50:
        return f"{nbytes / 2**40:.2g} TiB"
    for unit, scale in (("TiB", 2**40), ("GiB", 2**30), ("MiB", 2**20)):
        if nbytes >= scale:
            return f"{nbytes / scale:,.1f} {unit}"
    return f"{int(nbytes):,} bytes"


def memory_problem(nbytes: float, what: str) -> str | None:
    """A message when ``what`` (e.g. "a 8,000,000,000-token layout") would need more than the limit."""
    limit = memory_limit()
    if nbytes <= limit:
        return None
    return (
        f"{what} needs about {format_bytes(nbytes)} of memory, more than the {format_bytes(limit)} "
        "allowed (half of this machine's memory; SPARSEATTN_MEMORY_LIMIT sets another limit)"
    )
