"""Query grouping for PageWeaver's union kernel (numpy reference of the GPU search).

A :class:`Grouping` is a CSR list of query-id groups: ``ids`` int32 ``[Q]`` (every query exactly once,
group by group) and ``offsets`` int32 ``[num_groups + 1]``; group ``g`` is
``ids[offsets[g]:offsets[g+1]]``. The union kernel loads ``∪_{q∈g} S_q`` once per group and reads Q
rows / writes O rows by these ids.

* :func:`adjacent_groups` — the baseline: queries ``[gG, gG+G)`` form group ``g``.
* :func:`affinity_groups` — PageWeaver's bounded affinity search. Queries are cut into windows of
  ``W`` consecutive queries (the candidates of a group all lie in one window). Inside a window the
  search is a deterministic greedy over page bitsets, identical in ``kernels_cu/pw_grouping.cu``
  (one CTA per window, one thread per candidate):

  1. a new group is seeded with the lowest-index query not yet grouped;
  2. while the group has fewer than ``G`` members, add the ungrouped candidate whose selection grows
     the union least (``|S_c| − |U ∩ S_c|``, a popcount over bitsets), ties → larger overlap
     ``|U ∩ S_c|``, then the lower query index; a candidate that would make the union exceed
     ``max_union`` pages is not eligible; with no eligible candidate the group closes early.

  Each step assigns exactly one query per window, so the reference runs all windows in lockstep,
  vectorized (``W`` steps in all).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .captures import Capture

#: Default group size (the paper's "Union8") and candidate window.
DEFAULT_GROUP_SIZE = 8
DEFAULT_WINDOW = 64
#: One CTA per window, one thread per candidate: the window is bounded by the CTA size.
MAX_WINDOW = 1024
#: Field widths of the packed greedy key ``added << 42 | (OV_MAX − overlap) << 21 | index``.
KEY_INDEX_BITS = 21
KEY_OVERLAP_BITS = 21
OV_MAX = (1 << 20) - 1


_BYTE_POPCOUNT = np.array([i.bit_count() for i in range(256)], dtype=np.uint8)


def popcount(x: np.ndarray) -> np.ndarray:
    """Per-element popcount of a uint64 array (``np.bitwise_count`` on numpy >= 2)."""
    if hasattr(np, "bitwise_count"):
        return np.bitwise_count(x)
    return _BYTE_POPCOUNT[x.view(np.uint8)].reshape(*x.shape, 8).sum(axis=-1, dtype=np.uint8)


class GroupingError(ValueError):
    """A grouping argument is invalid; the message names the argument."""


@dataclass(frozen=True, eq=False)
class Grouping:
    """CSR query groups: ``ids`` int32 ``[Q]``, ``offsets`` int32 ``[num_groups + 1]``."""

    ids: np.ndarray
    offsets: np.ndarray
    group_size: int
    method: str = ""

    @property
    def num_groups(self) -> int:
        return int(self.offsets.shape[0] - 1)

    @property
    def num_queries(self) -> int:
        return int(self.ids.shape[0])

    @property
    def sizes(self) -> np.ndarray:
        """int64 ``[num_groups]`` members per group."""
        return np.diff(self.offsets.astype(np.int64))

    def padded(self, width: int | None = None) -> np.ndarray:
        """int32 ``[num_groups, width]`` member ids, ``-1`` padded (width defaults to the largest group)."""
        sizes = self.sizes
        width = int(sizes.max(initial=0)) if width is None else int(width)
        out = np.full((self.num_groups, width), -1, dtype=np.int32)
        col = np.arange(self.num_queries) - np.repeat(self.offsets[:-1].astype(np.int64), sizes)
        out[np.repeat(np.arange(self.num_groups), sizes), col] = self.ids
        return out

    def group_of(self) -> np.ndarray:
        """int64 ``[Q]``: the group of each query."""
        out = np.empty(self.num_queries, dtype=np.int64)
        out[self.ids] = np.repeat(np.arange(self.num_groups), self.sizes)
        return out

    def packed(self, pack: int) -> Grouping:
        """Consecutive runs of ``pack`` groups as one group each: the union kernel's tiles at that pack
        (where each run's union fits the tile's list, as on the built-in captures)."""
        starts = self.offsets[:: int(pack)]
        offsets = starts if starts[-1] == self.offsets[-1] else np.append(starts, self.offsets[-1])
        return Grouping(
            self.ids, offsets.astype(np.int32), self.group_size * int(pack), f"{self.method}x{pack}"
        )

    def __repr__(self) -> str:
        return f"Grouping({self.method!r}, queries={self.num_queries}, groups={self.num_groups})"


def validate_grouping(grouping: Grouping, num_queries: int, group_size: int | None = None) -> None:
    """Raise :class:`GroupingError` unless every query is in exactly one group of at most ``group_size``."""
    ids, offsets = np.asarray(grouping.ids), np.asarray(grouping.offsets)
    if ids.shape != (num_queries,):
        raise GroupingError(f"ids must have shape ({num_queries},), got {ids.shape}")
    if offsets.ndim != 1 or offsets.size < 1 or offsets[0] != 0 or offsets[-1] != num_queries:
        raise GroupingError(f"offsets must run from 0 to num_queries={num_queries}")
    sizes = np.diff(offsets.astype(np.int64))
    if (sizes <= 0).any():
        raise GroupingError(f"offsets: group {int(np.flatnonzero(sizes <= 0)[0])} is empty")
    cap = grouping.group_size if group_size is None else group_size
    if (sizes > cap).any():
        raise GroupingError(
            f"offsets: group {int(np.flatnonzero(sizes > cap)[0])} has more than {cap} queries"
        )
    if ids.size and (ids.min() < 0 or ids.max() >= num_queries):
        raise GroupingError(f"ids: query id out of range [0, {num_queries})")
    if np.bincount(ids, minlength=num_queries).max(initial=1) != 1:
        raise GroupingError("ids: a query appears in more than one group")


def _check_params(group_size, window, max_union, k):
    for name, v in (("group_size", group_size), ("window", window)):
        if isinstance(v, bool) or not isinstance(v, (int, np.integer)):
            raise TypeError(f"{name} must be an int, got {type(v).__name__}")
        if v < 1:
            raise GroupingError(f"{name} must be >= 1, got {v}")
    if window > MAX_WINDOW:
        raise GroupingError(f"window must be <= {MAX_WINDOW} (one CTA per window), got {window}")
    if max_union is not None:
        if isinstance(max_union, bool) or not isinstance(max_union, (int, np.integer)):
            raise TypeError(f"max_union must be an int or None, got {type(max_union).__name__}")
        if max_union < k:
            raise GroupingError(f"max_union must be >= k={k} (one query alone must fit), got {max_union}")


def adjacent_groups(num_queries: int, group_size: int = DEFAULT_GROUP_SIZE) -> Grouping:
    """The fixed baseline: group ``g`` = queries ``[g·G, min((g+1)·G, Q))``."""
    _check_params(group_size, 1, None, 0)
    offsets = np.minimum(np.arange(0, num_queries + group_size, group_size), num_queries)
    offsets = np.unique(offsets).astype(np.int32)
    return Grouping(np.arange(num_queries, dtype=np.int32), offsets, int(group_size), "adjacent")


def query_bitsets(pages: np.ndarray, num_pages: int) -> np.ndarray:
    """uint64 ``[Q, ⌈num_pages/64⌉]``: bit ``p`` set iff the query selected page ``p``."""
    Q = pages.shape[0]
    words = max(1, -(-num_pages // 64))
    bits = np.zeros(Q * words, dtype=np.uint64)
    valid = pages >= 0
    rows = np.broadcast_to(np.arange(Q)[:, None], pages.shape)[valid]
    p = pages[valid].astype(np.int64)
    np.bitwise_or.at(bits, rows * words + (p >> 6), np.left_shift(np.uint64(1), (p & 63).astype(np.uint64)))
    return bits.reshape(Q, words)


def affinity_groups(
    capture: Capture,
    group_size: int = DEFAULT_GROUP_SIZE,
    window: int = DEFAULT_WINDOW,
    max_union: int | None = None,
) -> Grouping:
    """PageWeaver's bounded affinity grouping (see the module docstring for the exact search)."""
    if not isinstance(capture, Capture):
        raise TypeError(f"capture must be a Capture, got {type(capture).__name__}")
    _check_params(group_size, window, max_union, capture.k)
    Q, W, G = capture.num_queries, int(window), int(group_size)
    cap = np.iinfo(np.int64).max // 4 if max_union is None else int(max_union)
    nW = -(-Q // W)
    bits = query_bitsets(capture.pages, capture.num_pages)
    B = np.zeros((nW * W, bits.shape[1]), dtype=np.uint64)
    B[:Q] = bits
    B = B.reshape(nW, W, -1)
    size = popcount(B).sum(axis=-1, dtype=np.int64)  # [nW, W]
    wlen = np.clip(Q - np.arange(nW) * W, 0, W)
    idx = np.arange(W, dtype=np.int64)
    avail = idx[None, :] < wlen[:, None]
    U = np.zeros((nW, B.shape[2]), dtype=np.uint64)
    usize = np.zeros(nW, dtype=np.int64)
    glen = np.zeros(nW, dtype=np.int64)
    cnt = np.zeros(nW, dtype=np.int64)
    ngroups = np.zeros(nW, dtype=np.int64)
    perm = np.full((nW, W), -1, dtype=np.int64)
    gstart = np.full((nW, W), -1, dtype=np.int64)
    big = np.iinfo(np.int64).max
    ar = np.arange(nW)
    for _ in range(W):
        active = cnt < wlen
        if not active.any():
            break
        ov = popcount(B & U[:, None, :]).sum(axis=-1, dtype=np.int64)
        added = size - ov
        elig = avail & (glen[:, None] > 0) & (usize[:, None] + added <= cap)
        key = np.where(elig, (added << 42) | ((OV_MAX - ov) << KEY_INDEX_BITS) | idx, big)
        best = key.argmin(axis=1)
        member = active & (key[ar, best] != big)
        seed = active & ~member
        chosen = np.where(member, best, avail.argmax(axis=1))
        a = ar[active]
        perm[a, cnt[a]] = chosen[a]
        s = ar[seed]
        gstart[s, ngroups[s]] = cnt[s]
        ngroups[s] += 1
        U[s] = B[s, chosen[s]]
        usize[s] = size[s, chosen[s]]
        glen[s] = 1
        m = ar[member]
        U[m] |= B[m, chosen[m]]
        usize[m] += added[m, chosen[m]]
        glen[m] += 1
        avail[a, chosen[a]] = False
        cnt[a] += 1
        glen[glen >= G] = 0
    base = (ar * W)[:, None]
    ids = (perm + base)[perm >= 0].astype(np.int32)
    offsets = np.concatenate([(gstart + base)[gstart >= 0], [Q]]).astype(np.int32)
    return Grouping(ids, offsets, G, "affinity")


def union_sizes(capture: Capture, grouping: Grouping) -> np.ndarray:
    """int64 ``[num_groups]``: ``|∪_{q∈g} S_q|`` per group."""
    members = grouping.padded()
    pages = np.where(members[:, :, None] >= 0, capture.pages[np.maximum(members, 0)], -1)
    srt = np.sort(pages.reshape(members.shape[0], -1), axis=1)
    first = np.ones_like(srt, dtype=bool)
    first[:, 1:] = srt[:, 1:] != srt[:, :-1]
    return (first & (srt >= 0)).sum(axis=1)
