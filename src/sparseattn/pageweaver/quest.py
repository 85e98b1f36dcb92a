"""Quest-style page selection: turn real Q/K arrays into a PageWeaver :class:`Capture`.

Per KV page ``p`` (tokens ``[p·P, (p+1)·P)`` of the context) the selector keeps a key statistic and
scores each query against it:

* ``stat="maxmin"`` (Quest): elementwise max ``kmax_p`` and min ``kmin_p`` of the page's keys; the
  score ``Σ_d max(q_d·kmax_pd, q_d·kmin_pd) = q⁺·kmax_p + q⁻·kmin_p`` is an upper bound of ``q·k``
  over the page's keys (``q⁺ = max(q, 0)``, ``q⁻ = min(q, 0)``);
* ``stat="mean"``: ``q·mean_p`` (the page's mean key).

With query heads sharing one KV head (GQA, ``q`` of shape ``[Q, h, d]``) the scores are summed over
the ``h`` heads, so the group shares one selection (as NSA does). The top ``k`` pages per query are
kept; with ``causal`` only pages ``≤ position // P`` compete (the query's own page included).
``sink_pages``/``local_pages`` optionally force the first pages and the window ending at the query's
page into the selection (NSA-style); Quest itself forces none.
"""

from __future__ import annotations

import numpy as np

from .captures import DEFAULT_PAGE_SIZE, Capture, CaptureError

STATS = ("maxmin", "mean")


def page_key_stats(keys: np.ndarray, page_size: int, stat: str = "maxmin"):
    """Per-page key statistics of ``keys`` float ``[L, d]``.

    Returns ``(kmax, kmin)`` float64 ``[num_pages, d]`` for ``"maxmin"``, ``(mean, None)`` for ``"mean"``;
    the last page may be partial (only its real tokens count).
    """
    k = keys.astype(np.float64, copy=False)
    starts = np.arange(0, k.shape[0], page_size)
    if stat == "maxmin":
        return np.maximum.reduceat(k, starts, axis=0), np.minimum.reduceat(k, starts, axis=0)
    counts = np.diff(np.append(starts, k.shape[0]))
    return np.add.reduceat(k, starts, axis=0) / counts[:, None], None


def quest_select(
    q: np.ndarray,
    keys: np.ndarray,
    k: int,
    *,
    page_size: int = DEFAULT_PAGE_SIZE,
    positions: np.ndarray | None = None,
    causal: bool = True,
    stat: str = "maxmin",
    sink_pages: int = 0,
    local_pages: int = 0,
    name: str = "quest",
    chunk: int = 4096,
) -> Capture:
    """A capture from queries ``q`` float ``[Q, d]`` or ``[Q, h, d]`` and keys float ``[L, d]``.

    ``positions`` int ``[Q]`` defaults to the last ``Q`` tokens of the context (``L − Q … L − 1``).
    """
    q = np.asarray(q)
    keys = np.asarray(keys)
    if not np.issubdtype(q.dtype, np.floating) or not np.issubdtype(keys.dtype, np.floating):
        raise TypeError(f"q and keys must be float arrays, got {q.dtype} and {keys.dtype}")
    if q.ndim == 2:
        q = q[:, None, :]
    if q.ndim != 3:
        raise CaptureError(f"q must be [Q, d] or [Q, h, d], got shape {q.shape}")
    if keys.ndim != 2 or keys.shape[1] != q.shape[2]:
        raise CaptureError(
            f"keys must be [L, d] with d = {q.shape[2]} (q's head dim), got shape {keys.shape}"
        )
    if stat not in STATS:
        raise CaptureError(f"stat must be one of {STATS}, got {stat!r}")
    if isinstance(k, bool) or not isinstance(k, (int, np.integer)) or k < 1:
        raise CaptureError(f"k must be a positive int, got {k!r}")
    L, Q = keys.shape[0], q.shape[0]
    if page_size <= 0 or page_size % 16:
        raise CaptureError(f"page_size must be a positive multiple of 16, got {page_size}")
    if positions is None:
        if Q > L:
            raise CaptureError(f"q has {Q} queries, more than the {L} context tokens (give positions)")
        positions = np.arange(L - Q, L, dtype=np.int64)
    positions = np.asarray(positions, dtype=np.int64)
    if positions.shape != (Q,):
        raise CaptureError(f"positions must have shape ({Q},), got {positions.shape}")
    if Q and (positions.min() < 0 or positions.max() >= L):
        raise CaptureError(f"positions must lie in [0, {L})")
    n = -(-L // page_size)
    a, b = page_key_stats(keys, page_size, stat)
    pages = np.full((Q, k), -1, dtype=np.int32)
    page = np.arange(n)
    m = min(k, n)
    for q0 in range(0, Q, chunk):
        qc = q[q0 : q0 + chunk].astype(np.float64)
        if stat == "maxmin":
            score = np.einsum("qhd,pd->qp", np.maximum(qc, 0), a) + np.einsum(
                "qhd,pd->qp", np.minimum(qc, 0), b
            )
        else:
            score = np.einsum("qhd,pd->qp", qc, a)
        cur = (positions[q0 : q0 + chunk] // page_size)[:, None]
        forced = (page < sink_pages) | ((page > cur - local_pages) & (page <= cur))
        score = np.where(forced, np.inf, score)
        if causal:
            score = np.where(page > cur, -np.inf, score)
        top = np.argpartition(-score, m - 1, axis=1)[:, :m]
        ok = np.take_along_axis(score, top, axis=1) > -np.inf
        sel = np.sort(np.where(ok, top, n), axis=1)
        pages[q0 : q0 + chunk, :m] = np.where(sel < n, sel, -1)
    meta = {
        "selector": {
            "kind": "quest",
            "stat": stat,
            "k": int(k),
            "heads": int(q.shape[1]),
            "sink_pages": int(sink_pages),
            "local_pages": int(local_pages),
        }
    }
    return Capture(
        pages=pages, positions=positions, context=L, page_size=page_size, causal=causal, name=name, meta=meta
    )
