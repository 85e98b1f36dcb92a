"""Command line: ``sparseattn analyze | workloads | figures | bench`` (also ``python -m sparseattn``).

Errors in user input (bad names, files, fields) print one line ``sparseattn: error: ...`` to stderr and
exit with status 2; a missing optional part (PageWeaver analysis, GPU benchmarks) exits with status 1.
"""

from __future__ import annotations

import argparse
import csv
import importlib
import io
import json
import math
import os
import sys
import threading
import time
import warnings
from dataclasses import dataclass

from . import __version__
from .analysis import ROUTE_CHOICES

PROG = "sparseattn"
FORMATS = ("table", "json", "csv")
PLOT_SUFFIXES = (".png", ".pdf", ".svg")
EXIT_USER_ERROR = 2
EXIT_UNAVAILABLE = 1


class UnavailableError(RuntimeError):
    """An optional part of the toolkit is not installed in this build."""


# --- output helpers -------------------------------------------------------------------------------
def _stdout_console():
    from rich.console import Console

    out = Console(file=sys.stdout, soft_wrap=False)
    if not out.is_terminal:  # pipes and files: do not squeeze tables into 80 columns
        out = Console(file=sys.stdout, width=320, soft_wrap=False)
    return out


def _stderr_console():
    from rich.console import Console

    return Console(file=sys.stderr)


def _json_safe(value):
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: _json_safe(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_json_safe(v) for v in value]
    return value


def _columns(rows: list[dict]) -> list[str]:
    cols: list[str] = []
    for row in rows:
        cols.extend(k for k in row if k not in cols and not isinstance(row[k], (list, dict)))
    return cols


def write_json(rows: list[dict], stream) -> None:
    json.dump(_json_safe(rows), stream, indent=2)
    stream.write("\n")


def write_csv(rows: list[dict], stream) -> None:
    cols = _columns(rows)
    buf = io.StringIO()
    writer = csv.DictWriter(buf, fieldnames=cols, extrasaction="ignore", lineterminator="\n")
    writer.writeheader()
    writer.writerows(rows)
    stream.write(buf.getvalue())


# --- tables ------------------------------------------------------------------------------------------
# Every table writes a kind of number the same way: pair counts in one unit per table (G, M or plain),
# occupancies as percentages, ratios with ×, missing values as –. Names are never cut.


@dataclass(frozen=True)
class Column:
    """One table column: the row field it shows, its header and how its cells are written."""

    key: str
    header: str
    kind: str = "text"  # text | name (never wrapped) | int | pairs | pct | ratio | dec1 | num


def _cell(kind: str, value, unit: tuple[float, str] = (1.0, "")) -> str:
    if value is None or value == "" or (isinstance(value, float) and not math.isfinite(value)):
        return "–"
    if kind in ("text", "name") or isinstance(value, (str, bool)):
        return str(value)
    if kind == "int":
        return f"{int(value):,}"
    if kind == "pairs":
        return _pairs(value, unit)
    if kind == "pct":
        return _pct(value)
    if kind == "ratio":
        return _times(value)
    if kind == "dec1":
        return f"{value:,.1f}"
    return f"{value:,}" if isinstance(value, int) else f"{value:,.4g}"


def _guess_columns(rows: list[dict]) -> list[Column]:
    """One column per field, the kind guessed from the values (for rows without a known layout)."""
    out = []
    for key in _columns(rows):
        values = [r[key] for r in rows if key in r and r[key] is not None]
        kind = (
            "num"
            if values and all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in values)
            else "text"
        )
        out.append(Column(key, key, "name" if not out else kind))
    return out


def make_table(
    rows: list[dict], columns: list[Column], title: str = "", caption: str = "", unit=None, total=None
):
    """A rich Table of ``rows`` (and a bold ``total`` row after a rule); ``pairs`` columns share
    ``unit`` (default: the unit of the table's largest count)."""
    from rich import box
    from rich.table import Table

    everything = [*rows, total] if total is not None else rows
    if unit is None:
        pair_values = [r.get(c.key) or 0 for r in everything for c in columns if c.kind == "pairs"]
        unit = _pair_unit(max(pair_values, default=0))
    table = Table(
        title=title or None,
        caption=caption or None,
        box=box.SIMPLE_HEAD,
        show_edge=False,
        pad_edge=False,
        collapse_padding=True,
    )
    for c in columns:
        numeric = c.kind not in ("text", "name")
        if c.kind == "name":
            longest = max([len(str(r.get(c.key, ""))) for r in everything] + [len(c.header)])
            table.add_column(c.header, no_wrap=True, min_width=longest)
        else:
            table.add_column(c.header, justify="right" if numeric else "left", no_wrap=numeric)
    for row in rows:
        table.add_row(*(_cell(c.kind, row.get(c.key), unit) for c in columns))
    if total is not None:
        table.add_section()
        table.add_row(*(_cell(c.kind, total.get(c.key), unit) for c in columns), style="bold")
    return table


def print_table(table, console=None) -> None:
    """Print ``table`` whole: wider than the terminal, it is printed at its natural width (the
    terminal wraps the lines) rather than with cut names or numbers."""
    from rich.console import Console
    from rich.measure import Measurement

    console = console or _stdout_console()
    width = Measurement.get(console, console.options.update(max_width=100_000), table).minimum
    if width > console.width:
        console = Console(file=console.file, width=width, soft_wrap=False)
    console.print(table)


def render_table(
    rows: list[dict], title: str = "", columns: list[Column] | None = None, caption: str = ""
) -> None:
    """A table of flat rows on stdout: the given columns, or one per field."""
    print_table(make_table(rows, columns or _guess_columns(rows), title, caption))


def emit(rows: list[dict], fmt: str, title: str = "", columns=None, caption: str = "") -> None:
    if fmt == "json":
        write_json(rows, sys.stdout)
    elif fmt == "csv":
        write_csv(rows, sys.stdout)
    else:
        render_table(rows, title, columns, caption)


# --- progress ---------------------------------------------------------------------------------------
class DelayedProgress:
    """A rich progress bar on stderr that appears only once the work has taken ``delay`` seconds."""

    def __init__(self, total: int, description: str, delay: float = 1.0):
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

        self._progress = Progress(
            TextColumn("{task.description}"),
            BarColumn(),
            MofNCompleteColumn(),
            TimeElapsedColumn(),
            console=_stderr_console(),
            transient=True,
        )
        self._task = self._progress.add_task(description, total=total)
        self._lock = threading.Lock()
        self._timer = threading.Timer(delay, self._start)
        self._timer.daemon = True
        self._started = self._closed = False

    def _start(self):
        with self._lock:
            if not self._closed:
                self._progress.start()
                self._started = True

    def update(self, description: str | None = None, advance: int = 0) -> None:
        kwargs = {"advance": advance}
        if description is not None:
            kwargs["description"] = description
        self._progress.update(self._task, **kwargs)

    def __enter__(self):
        self._timer.start()
        return self

    def __exit__(self, *exc):
        with self._lock:
            self._closed = True
            self._timer.cancel()
            if self._started:
                self._progress.stop()
        return False


# --- analyze ----------------------------------------------------------------------------------------
def _optional_module(name: str, what: str):
    """Import ``sparseattn.<name>``; a missing module is reported as :class:`UnavailableError`."""
    full = f"{__package__}.{name}"
    try:
        return importlib.import_module(full)
    except ModuleNotFoundError as err:
        if err.name is not None and full.startswith(err.name):
            raise UnavailableError(f"{what} ({full}) is not part of this build") from None
        raise


def _workloads_module():
    return _optional_module("workloads", "the built-in workloads")


def _selected_workloads(args) -> list:
    """Workload objects in the order asked: ``--workload`` names, then ``--layout`` files."""
    chosen = []
    names = args.workload or []
    if names or not args.layout:
        wl = _workloads_module()
        for name in names:
            if name not in wl.WORKLOADS:
                valid = ", ".join(wl.WORKLOADS)
                raise ValueError(f"--workload: unknown workload {name!r}; built-ins: {valid}")
        chosen.extend(wl.get_workload(n) for n in (names or list(wl.WORKLOADS)))
    if args.layout:
        layout_file = _optional_module("layout_file", "layout files")
        chosen.extend(layout_file.load_layout_file(path) for path in args.layout)
    return chosen


class AnalysisProgress:
    """Progress of an analysis on stderr, per slice of heads: a live bar on a terminal (after
    ``delay`` seconds), else one line per finished workload once the work has taken ``delay``."""

    def __init__(self, workloads: list, delay: float = 1.0, stream=None):
        self.stream = sys.stderr if stream is None else stream
        self.delay = delay
        self.total_heads = {id(w): int(getattr(w, "heads", 1)) for w in workloads}
        self.workloads = len(workloads)
        self.heads_seen: dict[int, int] = {}
        self.finished = 0
        self.start = time.monotonic()
        self._lock = threading.Lock()
        heads = sum(self.total_heads.values())
        self.bar = DelayedProgress(heads, "analysing", delay) if _is_terminal(self.stream) else None

    def __enter__(self):
        if self.bar is not None:
            self.bar.__enter__()
        return self

    def __exit__(self, *exc):
        if self.bar is not None:
            self.bar.__exit__(*exc)
        return False

    def __call__(self, workload, heads_done: int) -> None:
        """One slice of ``workload`` is done; ``heads_done`` of its heads so far."""
        with self._lock:
            total = self.total_heads[id(workload)]
            previous = self.heads_seen.get(id(workload), 0)
            self.heads_seen[id(workload)] = heads_done
            self.finished += heads_done == total
            if self.bar is not None:
                self.bar.update(f"{workload.name} {heads_done}/{total} heads", advance=heads_done - previous)
            elif heads_done == total and time.monotonic() - self.start >= self.delay:
                elapsed = time.monotonic() - self.start
                print(
                    f"{PROG}: analysed {workload.name} ({total} heads) "
                    f"[{self.finished}/{self.workloads} workloads, {elapsed:.1f} s]",
                    file=self.stream,
                    flush=True,
                )


def _is_terminal(stream) -> bool:
    try:
        return stream.isatty()
    except (AttributeError, ValueError):
        return False


def analyze_with_progress(workloads: list, seed: int = 0, route: str = "auto", cache=None) -> list:
    """OccupancyReport of each workload (in parallel slices, counts only), with progress on stderr;
    ``cache``: the count cache's folder (:mod:`sparseattn.countcache`), or None."""
    from .analysis import analyze_workloads

    with AnalysisProgress(workloads) as progress:
        return analyze_workloads(
            workloads, seed=seed, route=route, workers=None, on_progress=progress, fill=False, cache=cache
        )


def check_output_path(option: str, path: str, suffixes: tuple[str, ...]) -> None:
    """Refuse an output file that cannot be written, before any work is done."""
    from pathlib import Path

    target = Path(path)
    if target.suffix.lower() not in suffixes:
        raise ValueError(f"{option}: {path}: unsupported file type; use one of {', '.join(suffixes)}")
    folder = target.parent if str(target.parent) else Path(".")
    if target.is_dir():
        raise ValueError(f"{option}: {path}: is a folder")
    if not folder.is_dir():
        raise ValueError(f"{option}: {path}: folder {folder} does not exist")
    if not os.access(folder, os.W_OK) or (target.exists() and not os.access(target, os.W_OK)):
        raise ValueError(f"{option}: {path}: not writable")


def _pair_unit(largest: int) -> tuple[float, str]:
    """One unit for a whole table: G pairs like the paper (334.1G), M or plain counts for small layouts."""
    if largest >= 1e9:
        return 1e9, "G"
    if largest >= 1e6:
        return 1e6, "M"
    return 1.0, ""


def _pairs(pairs: int, unit: tuple[float, str]) -> str:
    scale, suffix = unit
    if not suffix:
        return f"{int(pairs):,}"
    value = pairs / scale
    return f"{value:,.1f}{suffix}" if value >= 10 else f"{value:,.2f}{suffix}"


def _pct(x: float) -> str:
    return "–" if not math.isfinite(x) else f"{100 * x:.1f}%"


def _times(x: float) -> str:
    return "–" if not math.isfinite(x) else f"{x:.2f}×"


#: The capacity table, the per-head tables and the capture table (headers fit 100 columns).
_PAIR_COLUMNS = [  # useful and physical pairs with the occupancies: shared by both tables below
    Column("useful_pairs", "useful", "pairs"),
    Column("bsa_physical", "BSA\nphysical", "pairs"),
    Column("kpage_physical", "KPage\nphysical", "pairs"),
    Column("kpage_physical_no_routing", "KPage\nno-route", "pairs"),
    Column("bsa_occupancy", "BSA\nocc.", "pct"),
    Column("kpage_occupancy", "KPage\nocc.", "pct"),
]
CAPACITY_COLUMNS = [
    Column("workload", "workload", "name"),
    Column("heads", "heads", "int"),
    Column("layers", "layers", "int"),
    *_PAIR_COLUMNS,
    Column("bsa_over_kpage", "BSA/\nKPage", "ratio"),
    Column("routing_gain", "route\ngain", "ratio"),
]
PER_HEAD_COLUMNS = [
    Column("head", "head", "int"),
    Column("selected_pairs", "selected\npairs", "int"),
    *_PAIR_COLUMNS,
    Column("dropped_pairs", "dropped\npairs", "int"),
]
CAPTURE_COLUMNS = [
    Column("capture", "capture", "name"),
    Column("grouping", "grouping", "name"),
    Column("queries", "queries", "int"),
    Column("k", "k", "int"),
    Column("page_loads", "page\nloads", "int"),
    Column("physical_pairs", "physical\npairs", "pairs"),
    Column("occupancy", "occ.", "pct"),
    Column("mean_union", "mean\nunion", "dec1"),
    Column("load_ratio_vs_per_query", "loads vs\nper-query", "ratio"),
    Column("load_ratio_vs_adjacent", "loads vs\nadjacent", "ratio"),
    Column("grouping_ms_cpu", "grouping\nms (CPU)", "dec1"),
]
WORKLOAD_COLUMNS = [
    Column("name", "name", "name"),
    Column("latent", "latent", "name"),
    Column("tile", "tile", "name"),
    Column("heads×dim", "heads\n×dim", "text"),
    Column("layers", "layers", "int"),
    Column("selection", "selection", "text"),
]


def _present(columns: list[Column], rows: list[dict]) -> list[Column]:
    return [c for c in columns if any(c.key in r for r in rows)]


def render_capacity_table(records: list[dict], total: dict, per_head: list[list[dict]] | None = None) -> None:
    """The capacity table (G pairs, occupancies, ratios), its TOTAL line and optional per-head tables."""
    all_layers = records[0]["scope"] == "all_layers"
    scope = "all layers of a step" if all_layers else "one attention call (one layer, one step)"
    unit = _pair_unit(max(total["bsa_physical"], total["kpage_physical_no_routing"], total["kpage_physical"]))
    table = make_table(
        records,
        CAPACITY_COLUMNS,
        title=f"QK pair capacity — {scope}, all heads; KPage route {records[0]['route']}",
        caption="occupancy = useful / physical; BSA/KPage = physical ratio",
        unit=unit,
        total=total,
    )
    console = _stdout_console()
    print_table(table, console)
    console.print(
        f"TOTAL: {_pairs(total['bsa_physical'], unit)} (BSA) → {_pairs(total['kpage_physical'], unit)} "
        f"(KPage) physical QK pairs for {_pairs(total['useful_pairs'], unit)} useful "
        f"(BSA/KPage {_times(total['bsa_over_kpage'])}; occupancy {_pct(total['bsa_occupancy'])} → "
        f"{_pct(total['kpage_occupancy'])})",
        highlight=False,
    )
    for rec, rows in zip(records, per_head or []):
        render_table(rows, title=f"{rec['workload']}: per head", columns=_present(PER_HEAD_COLUMNS, rows))


def _run_analyze(args) -> int:
    if args.captures is not None:
        return _run_capture_analysis(args)
    from .analysis import total_record

    if args.plot:
        check_output_path("--plot", args.plot, PLOT_SUFFIXES)
    workloads = _selected_workloads(args)
    cache = None
    if args.cache is not None:
        from .countcache import default_dir

        cache = default_dir() if args.cache == "" else args.cache
    reports = analyze_with_progress(workloads, seed=args.seed, route=args.route, cache=cache)
    records = [r.record(multiply_layers=args.layers) for r in reports]
    per_head = [r.per_head_records(multiply_layers=args.layers) for r in reports] if args.per_head else None
    if args.plot:
        from .plots import capacity_bar_chart

        capacity_bar_chart(
            records,
            path=args.plot,
            source=f"Counted by sparseattn analyze (seed {args.seed}, KPage route {args.route}).",
        )
    if args.format == "table":
        render_capacity_table(records, total_record(reports, multiply_layers=args.layers), per_head)
    elif args.format == "json":
        if per_head:
            records = [dict(rec, per_head=rows) for rec, rows in zip(records, per_head)]
        write_json(records, sys.stdout)
    else:
        rows = records if not per_head else [row for rows in per_head for row in rows]
        write_csv(rows, sys.stdout)
    if args.plot:
        print(f"wrote {args.plot}", file=sys.stderr)
    return 0


def _run_capture_analysis(args) -> int:
    if args.workload or args.layout or args.plot or args.per_head or args.cache is not None:
        raise ValueError(
            "--captures cannot be combined with --workload, --layout, --plot, --per-head or --cache"
        )
    pw = _optional_module("pageweaver.analysis", "PageWeaver capture analysis")
    paths = list(args.captures) or None
    rows = pw.analyze_captures(paths=paths, group_size=args.group_size, window=args.window)
    columns = _present(CAPTURE_COLUMNS, rows)  # JSON/CSV carry every field
    emit(
        rows,
        args.format,
        title=f"PageWeaver captures (group size {args.group_size}, window {args.window})",
        columns=columns if len(columns) >= 3 else None,
    )
    return 0


# --- workloads ---------------------------------------------------------------------------------------
def _triple(value) -> str:
    if value is None:
        return ""
    if isinstance(value, (tuple, list)):
        return "×".join(str(v) for v in value)
    return str(value)


def _tile_text(w) -> str:
    tile = getattr(w, "tile", None)
    block = getattr(w, "block_size", None)
    text = _triple(tile) if tile is not None else "clusters"
    return f"{text} (B={block})" if block else text


def workload_rows(workloads) -> list[dict]:
    """One flat row per workload: name, latent, tile, heads×dim, selection, description."""
    rows = []
    for w in workloads:
        rows.append(
            {
                "name": w.name,
                "latent": _triple(getattr(w, "latent", None) or getattr(w, "grid", None)),
                "tile": _tile_text(w),
                "heads×dim": f"{w.heads}×{w.head_dim}",
                "layers": getattr(w, "layers", ""),
                "selection": str(getattr(w, "selection", "") or ""),
                "description": w.description,
            }
        )
    return rows


def _run_workloads(args) -> int:
    wl = _workloads_module()
    emit(
        workload_rows(list(wl.WORKLOADS.values())),
        args.format,
        title="built-in workloads",
        columns=WORKLOAD_COLUMNS,
        caption="descriptions and public sources: --format json, or docs/workloads.md",
    )
    return 0


# --- figures -----------------------------------------------------------------------------------------
def _run_figures(args) -> int:
    from .figures import regenerate

    regenerate(args.out, only=args.only, bench_dir=args.bench_dir, log=lambda m: print(m, file=sys.stderr))
    return 0


def _add_figures_parser(sub) -> None:
    fig = sub.add_parser(
        "figures",
        help="regenerate every figure of figures/ from code and data/ (CPU)",
        description="Regenerate the figures (PNG, PDF, SVG) from code and data/: capacity "
        "analysis, PageWeaver analysis, and the recorded GPU runs of data/bench. Output is "
        "byte-for-byte reproducible.",
    )
    fig.add_argument("--out", metavar="DIR", help="output folder (default: the repository's figures/)")
    fig.add_argument(
        "--only",
        action="append",
        metavar="NAME",
        help="only this figure (repeatable), e.g. kpage_capacity; an unknown name lists them all",
    )
    fig.add_argument("--bench-dir", metavar="DIR", help="recorded benchmark runs (default: data/bench)")
    fig.set_defaults(func=_run_figures)


# --- bench -------------------------------------------------------------------------------------------
def load_bench():
    """Import :mod:`sparseattn.bench` (only when ``bench`` is asked for: it may need cupy)."""
    try:
        return _optional_module("bench", "benchmarks")
    except ImportError as err:  # a dependency of the benchmarks (cupy, torch) is missing
        missing = getattr(err, "name", None) or str(err)
        raise UnavailableError(
            f"sparseattn bench needs {missing!r}, which is not installed (pip install -e '.[gpu]')"
        ) from None


def _add_bench_parser(sub, bench) -> None:
    """The ``bench`` subcommand; its arguments come from ``bench.add_arguments`` when it is loaded."""
    help_text = (
        "benchmark the CUDA kernels on a GPU (needs the gpu extra); 'bench pageweaver --help': PageWeaver's "
        "suite; 'bench model wan --help': whole Wan steps; 'bench model prefill --help': a Llama prefill; "
        "'bench variants --help': an interleaved A/B of the KPage forward's (or backward's) builds"
    )
    if bench is None:
        sub.add_parser("bench", help=help_text, add_help=False)
        return
    doc = (bench.__doc__ or "").strip().split("\n")[0]
    parser = sub.add_parser("bench", help=help_text, description=doc or help_text)
    bench.add_arguments(parser)
    parser.set_defaults(func=bench.run)


# --- parser and entry point -------------------------------------------------------------------------
def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}") from None
    if value <= 0:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}")
    return value


def _nonneg_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a non-negative integer, got {text!r}") from None
    if value < 0:
        raise argparse.ArgumentTypeError(f"expected a non-negative integer, got {text!r}")
    return value


def build_parser(bench=None) -> argparse.ArgumentParser:
    """The argument parser; ``bench`` is the loaded :mod:`sparseattn.bench` module, if any."""
    parser = argparse.ArgumentParser(
        prog=PROG,
        description="Hardware-efficient sparse attention toolkit: "
        "occupancy analysis of sparse layouts, KPage / PageWeaver kernels.",
    )
    parser.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="{analyze,workloads,figures,bench}")
    sub.required = True

    an = sub.add_parser(
        "analyze",
        help="useful vs physical QK pairs (BSA vs KPage) of workloads or layouts",
        description="Occupancy analysis: useful vs physical query-key pairs of BSA and KPage "
        "tiles, summed over a workload's heads for one attention call (counting rules: docs/counting.md). "
        "With no --workload/--layout every built-in workload is analysed.",
    )
    an.add_argument("--workload", action="append", metavar="NAME", help="a built-in workload (repeatable)")
    an.add_argument("--layout", action="append", metavar="FILE", help="a JSON/YAML layout file (repeatable)")
    an.add_argument(
        "--captures",
        nargs="*",
        metavar="PATH",
        help="analyse PageWeaver selection captures (.npz) instead; no PATH = the built-ins",
    )
    an.add_argument("--format", choices=FORMATS, default="table", help="output format (default: table)")
    an.add_argument(
        "--plot",
        metavar="PATH",
        help="write a bar chart of useful vs BSA vs KPage physical pairs (PNG/PDF/SVG)",
    )
    an.add_argument(
        "--seed", type=_nonneg_int, default=0, help="seed of the synthetic selections (default 0)"
    )
    an.add_argument(
        "--route",
        choices=tuple(ROUTE_CHOICES),
        default="auto",
        help="KPage route: auto (64x256 when a Q block has <= 64 live rows, else 128x128), "
        "or one fixed route",
    )
    an.add_argument("--per-head", action="store_true", help="also report every head")
    an.add_argument(
        "--cache",
        nargs="?",
        const="",
        default=None,
        metavar="DIR",
        help="keep the counts of every slice of heads in DIR (default ~/.cache/sparseattn/analyze, or "
        "$SPARSEATTN_CACHE_DIR) and reuse them when the same workload, seed, route and code run again",
    )
    an.add_argument("--layers", action="store_true", help="multiply pair counts by the workload's layers")
    an.add_argument(
        "--group-size", type=_positive_int, default=8, help="captures: queries per group (default 8)"
    )
    an.add_argument(
        "--window",
        type=_positive_int,
        default=64,
        help="captures: grouping search window in queries (default 64)",
    )
    an.set_defaults(func=_run_analyze)

    wl = sub.add_parser("workloads", help="list the built-in workloads")
    wl.add_argument("--format", choices=FORMATS, default="table")
    wl.set_defaults(func=_run_workloads)

    _add_figures_parser(sub)
    _add_bench_parser(sub, bench)
    return parser


def _error(message: str, code: int) -> int:
    message = " ".join(str(message).split())  # one line
    print(f"{PROG}: error: {message}", file=sys.stderr)
    return code


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    bench = None
    if argv[:2] == ["bench", "pageweaver"]:  # PageWeaver's complete-call suite has its own arguments
        try:
            from .pageweaver import kernel_bench
        except ImportError as err:
            return _error(err, EXIT_UNAVAILABLE)
        return kernel_bench.main(argv[2:], prog=f"{PROG} bench pageweaver")
    if argv[:2] == [
        "bench",
        "variants",
    ]:  # an interleaved A/B of the KPage forward's or backward's compile-time builds
        from . import variant_ab

        try:
            return variant_ab.main(argv[2:], prog=f"{PROG} bench variants")
        except ImportError as err:
            return _error(err, EXIT_UNAVAILABLE)
    if argv[:3] == ["bench", "model", "prefill"]:  # a Llama-like prefill with PageWeaver's attention
        try:
            import torch  # noqa: F401 - the bench needs torch and transformers; say so plainly
            import transformers  # noqa: F401
        except ImportError as err:
            return _error(f"bench model prefill needs the transformers extra ({err})", EXIT_UNAVAILABLE)
        from .pageweaver import prefill_bench

        return prefill_bench.main(argv[3:], prog=f"{PROG} bench model prefill")
    if argv[:2] == ["bench", "model"]:  # whole-model steps (diffusers' Wan) have their own arguments too
        from . import model_bench

        return model_bench.main(argv[2:], prog=f"{PROG} bench model")
    if argv and argv[0] == "bench":
        try:
            bench = load_bench()
        except UnavailableError as err:
            return _error(err, EXIT_UNAVAILABLE)
    parser = build_parser(bench)
    args = parser.parse_args(argv)  # argparse exits 2 with a one-line usage error itself
    with warnings.catch_warnings():
        warnings.showwarning = _show_warning
        return _run(args)


def _show_warning(message, category, filename, lineno, file=None, line=None) -> None:
    text = " ".join(str(message).split())
    print(f"{PROG}: warning: {text}", file=sys.stderr if file is None else file)


def _run(args) -> int:
    try:
        return int(args.func(args) or 0)
    except (UnavailableError, ImportError) as err:
        return _error(err, EXIT_UNAVAILABLE)
    except FileNotFoundError as err:
        name = err.filename if err.filename is not None else ""
        return _error(f"{name}: file not found" if name else err, EXIT_USER_ERROR)
    except BrokenPipeError:
        return 0
    except MemoryError:
        return _error(
            "out of memory: the input is larger than this machine can analyse "
            "(fewer heads or a smaller layout; SPARSEATTN_MEMORY_LIMIT sets the size checks' limit)",
            EXIT_USER_ERROR,
        )
    except (ValueError, TypeError, OSError) as err:
        return _error(err, EXIT_USER_ERROR)
    except KeyboardInterrupt:
        return _error("interrupted", 130)


if __name__ == "__main__":  # pragma: no cover
    raise SystemExit(main())
