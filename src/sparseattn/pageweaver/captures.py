"""PageWeaver selection captures: per-query selected KV-page ids over a paged KV cache.

A :class:`Capture` holds, for ``Q`` queries of one attention head group (the query heads that share
one KV head and one selection, as in NSA/DSA), the pages each query selected:

* ``pages``     int32 ``[Q, k]``: page ids, valid ids first, ``-1`` padding at the end of a row;
  a page ``p`` covers tokens ``[p·P, (p+1)·P)`` of the KV cache (``P = page_size``);
* ``positions`` int64 ``[Q]``: the token position of each query (its own key is at that position);
* ``context``   tokens in the KV cache; ``num_pages = ⌈context / P⌉``.

Causal captures never select a page past the query's own page ``positions // P`` (tokens after the
query inside its own page are masked by the kernel, not by the selection).

No public capture set exists, so :func:`generate_capture` builds one from a documented, seeded model
(attention-sink pages + a local window + neighbour-correlated far pages + random far pages),
calibrated to the published statistics (see :data:`STYLES`); :mod:`.quest` turns real Q/K arrays into
a capture. Captures are saved as compressed ``.npz`` (page ids stored as int16 when they fit).
"""

from __future__ import annotations

import json
import os
import zipfile
import zlib
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from ..constants import PAGE_ROWS

#: Version of the ``.npz`` layout written by :meth:`Capture.save`.
CAPTURE_FORMAT = 1

DEFAULT_PAGE_SIZE = 64


class CaptureError(ValueError):
    """A capture is malformed; the message names the field (also in ``field``) and the problem."""

    def __init__(self, message: str, field: str | None = None):
        super().__init__(message)
        self.field = field

    def __reduce__(self):
        return type(self), (self.args[0], self.field)


class CaptureTypeError(CaptureError, TypeError):
    """A capture field has the wrong type or dtype (e.g. float positions)."""


class CaptureFileError(CaptureError):
    """A capture file cannot be read: ``FILE: field 'name': problem`` (or ``FILE: problem``)."""

    def __init__(self, path, message: str, field: str | None = None):
        text = f"{path}: field '{field}': {message}" if field else f"{path}: {message}"
        super().__init__(text, field)
        self.path = str(path)
        self.detail = message

    def __reduce__(self):
        return type(self), (self.path, self.detail, self.field)


def _check_int_array(name: str, value) -> np.ndarray:
    try:
        arr = np.asarray(value)
    except (TypeError, ValueError):
        arr = np.asarray(value, dtype=object)
    if arr.dtype == np.bool_ or not np.issubdtype(arr.dtype, np.integer):
        raise CaptureTypeError(f"{name} must be an integer array, got dtype {arr.dtype}", name)
    return arr


def _check_int(name: str, value) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        raise CaptureTypeError(f"{name} must be an integer, got {value!r}", name)
    return int(value)


class CaptureShape:
    """The sizes every selection of pages shares, from its ``pages`` ``[Q, k]``, ``context`` and
    ``page_size`` (a host :class:`Capture`, or the kernels' device capture)."""

    @property
    def num_queries(self) -> int:
        return int(self.pages.shape[0])

    @property
    def k(self) -> int:
        """Selection width (columns of ``pages``); a row may hold fewer valid ids."""
        return int(self.pages.shape[1])

    @property
    def num_pages(self) -> int:
        return -(-self.context // self.page_size)


@dataclass(frozen=True, eq=False)
class Capture(CaptureShape):
    """Per-query selected page ids (see the module docstring for the fields' meaning)."""

    pages: np.ndarray
    positions: np.ndarray
    context: int
    page_size: int = DEFAULT_PAGE_SIZE
    causal: bool = True
    name: str = ""
    meta: dict = field(default_factory=dict)

    def __post_init__(self):
        if _check_int("page_size", self.page_size) <= 0 or self.page_size % PAGE_ROWS:
            raise CaptureError(
                f"page_size must be a positive multiple of {PAGE_ROWS}, got {self.page_size}", "page_size"
            )
        if _check_int("context", self.context) <= 0:
            raise CaptureError(f"context must be positive, got {self.context}", "context")
        if not isinstance(self.causal, (bool, np.bool_)):
            raise CaptureTypeError(f"causal must be true or false, got {self.causal!r}", "causal")
        pages = _check_int_array("pages", self.pages)
        if pages.ndim != 2:
            raise CaptureError(f"pages must be 2-D [num_queries, k], got shape {pages.shape}", "pages")
        if pages.shape[0] == 0:
            raise CaptureError("pages holds no queries (shape [0, k])", "pages")
        if pages.shape[1] == 0:
            raise CaptureError("pages must have k >= 1 columns", "pages")
        positions = _check_int_array("positions", self.positions)
        if positions.shape != (pages.shape[0],):
            raise CaptureError(
                f"positions must have shape [num_queries] = ({pages.shape[0]},), got {positions.shape}",
                "positions",
            )
        object.__setattr__(self, "context", int(self.context))
        object.__setattr__(self, "page_size", int(self.page_size))
        object.__setattr__(self, "causal", bool(self.causal))
        if positions.size and (int(positions.min()) < 0 or int(positions.max()) >= self.context):
            bad = int(np.flatnonzero((positions < 0) | (positions >= self.context))[0])
            raise CaptureError(
                f"positions: query {bad} has position {int(positions[bad])} outside [0, context={self.context})",
                "positions",
            )
        num_pages = self.num_pages
        # Range-checked in the array's own dtype (any integer width, signed or not) before the cast
        # to int32 below, so an id such as 2**40 is refused instead of wrapping to a valid page.
        if pages.size and (int(pages.min()) < -1 or int(pages.max()) >= num_pages):
            r, c = np.argwhere((pages < -1) | (pages >= num_pages))[0]
            raise CaptureError(
                f"pages: page id {int(pages[r, c])} of query {r} is out of range [0, num_pages={num_pages}) "
                f"(context {self.context}, page_size {self.page_size}; -1 is the only padding value)",
                "pages",
            )
        pages = pages.astype(np.int32, copy=False)
        positions = positions.astype(np.int64, copy=False)
        valid = pages >= 0
        late = valid[:, 1:] & ~valid[:, :-1]
        if late.any():
            r = int(np.argwhere(late)[0, 0])
            raise CaptureError(
                f"pages: row {r} has a page id after -1 padding (pad only at the row's end)", "pages"
            )
        srt = np.sort(np.where(valid, pages, -1 - np.arange(pages.shape[1])), axis=1)
        dup = (srt[:, 1:] == srt[:, :-1]) & (srt[:, 1:] >= 0)
        if dup.any():
            r, c = np.argwhere(dup)[0]
            raise CaptureError(
                f"pages: duplicate page {int(srt[r, c + 1])} in the selection of query {r}", "pages"
            )
        if self.causal:
            beyond = pages > (positions // self.page_size)[:, None]
            if beyond.any():
                r, c = np.argwhere(beyond)[0]
                raise CaptureError(
                    f"pages: non-causal selection: query {r} at position {int(positions[r])} (page "
                    f"{int(positions[r] // self.page_size)}) selects page {int(pages[r, c])}",
                    "pages",
                )
        object.__setattr__(self, "pages", pages)
        object.__setattr__(self, "positions", positions)
        if not isinstance(self.meta, dict):
            raise CaptureTypeError(f"meta must be a mapping, got {type(self.meta).__name__}", "meta")
        object.__setattr__(self, "meta", dict(self.meta))

    # ---- shape (num_queries, k, num_pages: CaptureShape) ----------------------------------------
    @property
    def counts(self) -> np.ndarray:
        """int64 ``[Q]``: selected pages per query, ``|S_q|``."""
        return (self.pages >= 0).sum(axis=1)

    def __repr__(self) -> str:
        return (
            f"Capture({self.name!r}, queries={self.num_queries}, k={self.k}, context={self.context}, "
            f"page_size={self.page_size}, causal={self.causal})"
        )

    # ---- I/O ----------------------------------------------------------------------------------
    def save(self, path) -> Path:
        """Write ``path`` (``.npz``, compressed); page ids as int16 when ``num_pages <= 32767``."""
        path = Path(path)
        page_dtype = np.int16 if self.num_pages <= np.iinfo(np.int16).max else np.int32
        contiguous = self.num_queries > 0 and bool(np.all(np.diff(self.positions) == 1))
        arrays = {"pages": self.pages.astype(page_dtype)}
        if not contiguous:
            arrays["positions"] = self.positions.astype(np.int32 if self.context < 2**31 else np.int64)
        header = {
            "format": CAPTURE_FORMAT,
            "name": self.name,
            "context": self.context,
            "page_size": self.page_size,
            "causal": self.causal,
            "num_queries": self.num_queries,
            "k": self.k,
            "query_start": int(self.positions[0]) if contiguous else None,
            "meta": self.meta,
        }
        arrays["header"] = np.array(json.dumps(header))
        np.savez_compressed(path, **arrays)
        return path if path.suffix == ".npz" else path.with_name(path.name + ".npz")

    @classmethod
    def load(cls, path) -> Capture:
        """Read a capture written by :meth:`save` (page ids back to int32; validated).

        Raises :class:`CaptureFileError` (``FILE: field '...': problem``) for a missing file and for
        anything that is not a valid capture file.
        """
        path = Path(path)
        if not path.exists():
            raise CaptureFileError(path, "file not found")
        if path.is_dir():
            raise CaptureFileError(path, "is a folder, not a capture .npz file")
        try:
            with np.load(path, allow_pickle=False) as z:
                arrays = {name: z[name] for name in z.files}
        except (OSError, ValueError, EOFError, zipfile.BadZipFile, zlib.error, AttributeError) as err:
            raise CaptureFileError(
                path, f"not a capture .npz file (numpy could not read it: {_reason(err)})"
            ) from None
        for name in ("header", "pages"):
            if name not in arrays:
                raise CaptureFileError(path, "is missing (not a capture .npz?)", name)
        header = _read_header(path, arrays["header"])
        fields = {}
        for name in ("context", "page_size"):
            if name not in header:
                raise CaptureFileError(path, "is missing from the header", name)
            fields[name] = header[name]
        fields["causal"] = header.get("causal", True)
        fields["name"] = header.get("name") or path.stem
        fields["meta"] = header.get("meta", {})
        if not isinstance(fields["name"], str):
            raise CaptureFileError(path, f"must be a string, got {fields['name']!r}", "name")
        if "positions" in arrays:
            fields["positions"] = arrays["positions"]
        else:
            start = header.get("query_start")
            if isinstance(start, bool) or not isinstance(start, int):
                raise CaptureFileError(
                    path,
                    f"must be an integer when the file has no 'positions' array, got {start!r}",
                    "query_start",
                )
            count = arrays["pages"].shape[0] if arrays["pages"].ndim else 0
            if not 0 <= start <= np.iinfo(np.int64).max - count:  # positions are int64: refuse, never wrap
                raise CaptureFileError(
                    path, f"{start} is not a query position (0 to 2^63 - 1)", "query_start"
                )
            fields["positions"] = start + np.arange(count, dtype=np.int64)
        try:
            # no cast here: __post_init__ range-checks the ids in the stored dtype before narrowing
            return cls(pages=_check_int_array("pages", arrays["pages"]), **fields)
        except CaptureError as err:
            detail = str(err)
            if err.field:
                detail = detail.removeprefix(f"{err.field}: ").removeprefix(f"{err.field} ")
            raise CaptureFileError(path, detail, err.field) from None


def _reason(err: BaseException) -> str:
    if isinstance(err, ValueError) and "pickled" in str(err):
        return "it holds pickled Python objects or is not a numpy file at all"
    return str(err) or type(err).__name__


def _read_header(path: Path, raw: np.ndarray) -> dict:
    if raw.ndim != 0 or raw.dtype.kind not in "US":
        raise CaptureFileError(
            path, f"must be a JSON text, got an array of {raw.dtype} {raw.shape}", "header"
        )
    text = raw.item()
    try:
        header = json.loads(text.decode("utf-8") if isinstance(text, bytes) else text)
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise CaptureFileError(path, f"is not valid JSON ({err})", "header") from None
    if not isinstance(header, dict):
        raise CaptureFileError(path, f"must be a JSON object, got {type(header).__name__}", "header")
    if header.get("format") != CAPTURE_FORMAT:
        raise CaptureFileError(
            path, f"{header.get('format')!r} is not the supported {CAPTURE_FORMAT}", "format"
        )
    return header


def capture_path(capture) -> Path:
    """The file a path or a built-in name (``"nsa_32k"``) stands for."""
    path = Path(capture)
    if not path.exists() and str(capture) in BUILTIN_CAPTURES:
        path = builtin_capture_dir() / f"{capture}.npz"
    return path


def load_capture(capture) -> Capture:
    """A :class:`Capture` from a capture, a path, or a built-in name (``"nsa_32k"``)."""
    if isinstance(capture, Capture):
        return capture
    return Capture.load(capture_path(capture))


# ---- statistics ---------------------------------------------------------------------------------
def _distinct_per_row(pages: np.ndarray) -> np.ndarray:
    """Distinct non-negative ids per row of int ``[n, m]``."""
    srt = np.sort(pages, axis=1)
    first = np.ones_like(srt, dtype=bool)
    first[:, 1:] = srt[:, 1:] != srt[:, :-1]
    return (first & (srt >= 0)).sum(axis=1)


def window_union_sizes(capture: Capture, span: int) -> np.ndarray:
    """Distinct pages of each run of ``span`` adjacent queries (full runs only), int64 ``[Q // span]``."""
    n = capture.num_queries // span
    if n == 0:
        return np.zeros(0, dtype=np.int64)
    return _distinct_per_row(capture.pages[: n * span].reshape(n, span * capture.k))


def adjacent_jaccard(capture: Capture) -> np.ndarray:
    """Jaccard index of the page sets of queries ``q`` and ``q+1``, float64 ``[Q-1]``."""
    p = capture.pages
    if p.shape[0] < 2:
        return np.zeros(0)
    pair = np.concatenate([p[:-1], p[1:]], axis=1)
    union = _distinct_per_row(pair)
    counts = (p >= 0).sum(axis=1)
    inter = counts[:-1] + counts[1:] - union
    return np.where(union > 0, inter / np.maximum(union, 1), 1.0)


def capture_stats(capture: Capture) -> dict:
    """The calibration statistics: mean adjacent Jaccard, mean distinct pages of 4 and 8 adjacent queries
    (``None`` where the capture is too short)."""

    def mean(x):
        return float(x.mean()) if x.size else None

    return {
        "adjacent_jaccard": mean(adjacent_jaccard(capture)),
        "union4_mean": mean(window_union_sizes(capture, 4)),
        "union8_mean": mean(window_union_sizes(capture, 8)),
        "mean_selected": mean(capture.counts),
    }


# ---- the seeded generator -----------------------------------------------------------------------
@dataclass(frozen=True)
class GeneratorConfig:
    """Parameters of :func:`generate_capture` (token counts are converted to pages of ``page_size``).

    Per query at position ``t`` (current page ``c = t // P``), pages are ranked by a synthetic score and
    the top ``k = budget_tokens / P`` causal pages are kept:

    * ``sink_tokens``  — the first pages (attention sinks), always kept;
    * ``local_tokens`` — the window of pages ending at ``c``, always kept;
    * neighbour-correlated far pages: the queries are cut into runs (segments) of mean length
      ``segment_mean``; each run follows one *topic*, a set of far pages drawn from a pool of
      ``topics`` topics per ``topic_span`` queries (runs of one topic recur inside a span, so queries
      that are not adjacent can share pages — the affinity grouping's room);
    * random far pages: each topic page is dropped for one query with probability ``drop`` and the
      free slots are filled by uniformly random causal far pages.
    """

    context: int
    page_size: int = DEFAULT_PAGE_SIZE
    budget_tokens: int = 1024
    sink_tokens: int = 64
    local_tokens: int = 128
    num_queries: int | None = None
    segment_mean: float = 24.0
    topics: int = 3
    topic_span: int = 256
    drop: float = 0.05
    seed: int = 0

    @property
    def k(self) -> int:
        return max(1, self.budget_tokens // self.page_size)

    @property
    def sink_pages(self) -> int:
        return -(-self.sink_tokens // self.page_size) if self.sink_tokens > 0 else 0

    @property
    def local_pages(self) -> int:
        return -(-self.local_tokens // self.page_size) if self.local_tokens > 0 else 0


#: Selection styles of the built-in captures. NSA-like: 16 pages of 64 (1,024 tokens: 1 sink page,
#: 2 local pages, 13 far pages, as in anchors/peers3_flashinfer_probe.py); DSA-like: 2,048 tokens
#: (DeepSeek-V3.2's top-2048 indexer) = 32 pages of 64. Calibration targets (published statistics):
#: adjacent queries' page sets have Jaccard ≈ 0.9 at 8K, and 4 adjacent queries pick ≈ 22 distinct
#: blocks of the 64 they load. For k = 16 both cannot hold at once: with d_i = |S_{i+1} \ S_i|,
#: J_i ≤ 1 − d_i/16 and distinct(4) ≤ 16 + Σ d_i ≤ 16 + 48·(1 − J̄) = 20.8 at J̄ = 0.9. So the 8K
#: captures are calibrated to Jaccard ≈ 0.9 and the 32K/64K ones to ≈ 22 distinct of 64 (NSA-like;
#: DSA-like at the same ratio, ≈ 44 distinct of the 128 pages 4 queries load).
STYLES = {
    "nsa": {"budget_tokens": 1024, "sink_tokens": 64, "local_tokens": 128},
    "dsa": {"budget_tokens": 2048, "sink_tokens": 64, "local_tokens": 256},
}

#: name -> (style, context, generator overrides); every query of the context is captured (a full
#: causal prefill). ``drop`` was calibrated by bisection on :func:`capture_stats` to the targets
#: above (check: ``python -m sparseattn.pageweaver.captures --stats``).
BUILTIN_CAPTURES = {
    "nsa_8k": ("nsa", 8192, {"drop": 0.036, "segment_mean": 40.0, "seed": 801}),
    "nsa_32k": ("nsa", 32768, {"drop": 0.112, "segment_mean": 24.0, "seed": 3201}),
    "nsa_64k": ("nsa", 65536, {"drop": 0.105, "segment_mean": 24.0, "seed": 6401}),
    "dsa_8k": ("dsa", 8192, {"drop": 0.046, "segment_mean": 40.0, "seed": 802}),
    "dsa_32k": ("dsa", 32768, {"drop": 0.122, "segment_mean": 24.0, "seed": 3202}),
    "dsa_64k": ("dsa", 65536, {"drop": 0.106, "segment_mean": 24.0, "seed": 6402}),
}


def builtin_capture_dir() -> Path:
    env = os.environ.get("SPARSEATTN_CAPTURE_DIR")
    if env:
        return Path(env)
    return Path(__file__).resolve().parents[3] / "data" / "captures"


def builtin_capture_paths() -> list[Path]:
    return [builtin_capture_dir() / f"{name}.npz" for name in BUILTIN_CAPTURES]


def builtin_config(name: str) -> GeneratorConfig:
    if name not in BUILTIN_CAPTURES:
        raise KeyError(f"unknown built-in capture {name!r}; known: {sorted(BUILTIN_CAPTURES)}")
    style, context, overrides = BUILTIN_CAPTURES[name]
    return GeneratorConfig(context=context, **STYLES[style], **overrides)


def _topic_pools(cfg: GeneratorConfig, rng, first_page: np.ndarray, nfar: int) -> np.ndarray:
    """int64 ``[spans, topics, nfar]`` far pages per topic, drawn below each span's first local window."""
    num_pages = -(-cfg.context // cfg.page_size)
    spans = first_page.shape[0]
    lo = cfg.sink_pages
    hi = np.maximum(first_page - cfg.local_pages + 1, lo)  # far pages: [lo, hi)
    out = np.full((spans, cfg.topics, nfar), -1, dtype=np.int64)
    if nfar == 0:
        return out
    for s0 in range(0, spans, 64):  # chunks bound the [spans, topics, num_pages] random draw
        s1 = min(spans, s0 + 64)
        r = rng.random((s1 - s0, cfg.topics, num_pages))
        page = np.arange(num_pages)
        ok = (page >= lo) & (page < hi[s0:s1, None, None])
        r = np.where(ok, r, -1.0)
        m = min(nfar, num_pages)
        top = np.argpartition(-r, m - 1, axis=-1)[..., :m]
        good = np.take_along_axis(r, top, axis=-1) >= 0
        out[s0:s1, :, :m] = np.where(good, top, -1)
    return out


def generate_capture(config: GeneratorConfig, name: str = "") -> Capture:
    """A seeded synthetic causal capture (see :class:`GeneratorConfig` for the model)."""
    cfg = config
    P, L = cfg.page_size, cfg.context
    if P <= 0 or P % PAGE_ROWS:
        raise CaptureError(f"page_size must be a positive multiple of {PAGE_ROWS}, got {P}")
    Q = L if cfg.num_queries is None else int(cfg.num_queries)
    if not 0 < Q <= L:
        raise CaptureError(f"num_queries must be in [1, context={L}], got {cfg.num_queries}")
    if not 0.0 <= cfg.drop <= 1.0:
        raise CaptureError(f"drop must be a probability, got {cfg.drop}")
    if cfg.segment_mean < 1 or cfg.topics < 1 or cfg.topic_span < 1:
        raise CaptureError("segment_mean, topics and topic_span must be >= 1")
    rng = np.random.default_rng(cfg.seed)
    k, num_pages = cfg.k, -(-L // P)
    nfar = max(0, k - cfg.sink_pages - cfg.local_pages)
    positions = np.arange(L - Q, L, dtype=np.int64)
    cur = positions // P
    span = np.arange(Q) // cfg.topic_span
    pools = _topic_pools(cfg, rng, cur[:: cfg.topic_span], nfar)
    seg = np.cumsum(rng.random(Q) < 1.0 / cfg.segment_mean)
    topic = rng.integers(0, cfg.topics, seg[-1] + 1)[seg]
    pages = np.full((Q, k), -1, dtype=np.int32)
    page = np.arange(num_pages)
    chunk = max(1, (1 << 22) // num_pages)
    for q0 in range(0, Q, chunk):
        q1 = min(Q, q0 + chunk)
        c = cur[q0:q1, None]
        score = rng.random((q1 - q0, num_pages))
        always = (page < cfg.sink_pages) | (page > c - cfg.local_pages)
        score += np.where(always, 4.0, 0.0)
        far = pools[span[q0:q1], topic[q0:q1]]  # [n, nfar]
        keep = (far >= 0) & (rng.random(far.shape) >= cfg.drop)
        rows = np.broadcast_to(np.arange(q1 - q0)[:, None], far.shape)
        score[rows[keep], far[keep]] += 2.0
        score = np.where(page > c, -np.inf, score)
        m = min(k, num_pages)
        top = np.argpartition(-score, m - 1, axis=1)[:, :m]
        ok = np.isfinite(np.take_along_axis(score, top, axis=1))
        sel = np.sort(np.where(ok, top, num_pages), axis=1)
        pages[q0:q1, :m] = np.where(sel < num_pages, sel, -1)
    meta = {"generator": {k_: getattr(cfg, k_) for k_ in cfg.__dataclass_fields__}}
    cap = Capture(pages=pages, positions=positions, context=L, page_size=P, causal=True, name=name, meta=meta)
    cap.meta["stats"] = capture_stats(cap)
    return cap


def write_builtin_captures(out_dir=None, names=None) -> list[Path]:
    """(Re)generate the built-in captures into ``out_dir`` (default ``data/captures``)."""
    out = Path(out_dir) if out_dir is not None else builtin_capture_dir()
    out.mkdir(parents=True, exist_ok=True)
    paths = []
    for name in names or BUILTIN_CAPTURES:
        cap = generate_capture(builtin_config(name), name=name)
        style = BUILTIN_CAPTURES[name][0]
        cap.meta["style"] = style
        paths.append(cap.save(out / f"{name}.npz"))
    return paths


def main(argv=None) -> None:
    import argparse

    ap = argparse.ArgumentParser(description="PageWeaver built-in captures")
    ap.add_argument("--write", metavar="DIR", help="regenerate the six built-in captures into DIR")
    ap.add_argument("--stats", nargs="*", metavar="PATH", help="print calibration statistics")
    args = ap.parse_args(argv)
    if args.write:
        for p in write_builtin_captures(args.write):
            print(p, f"{p.stat().st_size / 1e6:.2f} MB")
    if args.stats is not None:
        for p in args.stats or builtin_capture_paths():
            cap = Capture.load(p)
            print(cap.name, cap.num_queries, cap.k, {k: round(v, 3) for k, v in capture_stats(cap).items()})


if __name__ == "__main__":
    main()
