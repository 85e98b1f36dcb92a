"""User layout files: a workload described in JSON or YAML.

Schema (``*.json``, ``*.yaml`` or ``*.yml``; see ``data/workloads/`` for examples)::

    name: my_layout            # default: the file name without extension
    description: free text     # optional
    grid: [T, H, W]            # latent, tokens in raster order            (required)
    tile: [t, h, w]            # tile; may be omitted for kind svg2         (required otherwise)
    block_size: 128            # slots per logical block, multiple of 16    (default 128)
    padding: prefix            # prefix | inplace                           (default prefix)
    heads: 8                   # attention heads per layer                  (default 1)
    layers: 30                 # layers, for per-model totals               (default 1)
    head_dim: 128              # head dimension                             (default 128)
    selection:
      kind: sta                # sta | ssta | vsa | svg2 | random | blocks  (required)
      window: [3, 3, 3]        # sta, ssta: window in tiles (or one triple per head)
      clamp: true              # sta, ssta: shift windows inward at borders (default true)
      topk: 32                 # ssta: extra tiles per Q tile; vsa: K blocks per Q block
      q_clusters: 300          # svg2 (defaults 300 / 1000 / 0.9 / 0.1)
      k_clusters: 1000
      top_p: 0.9               # in (0, 1]
      min_fraction: 0.1        # in [0, 1]
      density: 0.2             # random: in (0, 1]
      blocks: [[h, i, j], ...] # blocks: (head, Q block, K block) rows, or per-head lists blocks[h][i] = [j, ...]
      seed: 0                  # optional: pins the seed of data-dependent selections

Every problem raises :class:`LayoutFileError` naming the file and the field, e.g.
``my.yaml: field 'tile': tile[1]=9 is larger than grid[1]=8``.
"""

from __future__ import annotations

import json
from pathlib import Path

import yaml

from .workloads import COMMON_SELECTION_PARAMS, SELECTION_PARAMS, Selection, Workload, WorkloadError

TOP_LEVEL_FIELDS = (
    "name",
    "description",
    "grid",
    "tile",
    "block_size",
    "padding",
    "heads",
    "layers",
    "head_dim",
    "selection",
)
SELECTION_FIELDS = tuple(
    dict.fromkeys(COMMON_SELECTION_PARAMS + tuple(k for p in SELECTION_PARAMS.values() for k in p))
)
#: Layout files larger than this are refused before parsing (an explicit block list of a million
#: pairs is about 20 MB of YAML).
MAX_FILE_BYTES = 64 * 2**20

DEFAULTS = {"block_size": 128, "padding": "prefix", "heads": 1, "layers": 1, "head_dim": 128}


class LayoutFileError(ValueError):
    """A layout file cannot be read or is invalid; the message names the file and the field."""

    def __init__(self, path, message: str, field: str | None = None):
        text = f"{path}: field '{field}': {message}" if field else f"{path}: {message}"
        super().__init__(text)
        self.path = str(path)
        self.field = field
        self.detail = message

    def __reduce__(self):
        return type(self), (self.path, self.detail, self.field)


class _DuplicateKey(ValueError):
    def __init__(self, key, where: str = ""):
        super().__init__(f"appears twice{where}")
        self.key = str(key)


class _UniqueKeyLoader(yaml.SafeLoader):
    """YAML loader that refuses a key given twice in one mapping (plain YAML keeps the last)."""

    def construct_mapping(self, node, deep=False):
        seen: dict = {}
        for key_node, _ in node.value:
            if key_node.tag == "tag:yaml.org,2002:merge":
                continue
            key = self.construct_object(key_node, deep=deep)
            line = key_node.start_mark.line + 1
            try:
                if key in seen:
                    raise _DuplicateKey(key, f" (lines {seen[key]} and {line})")
            except TypeError:  # an unhashable key: SafeLoader reports it below
                continue
            seen[key] = line
        return super().construct_mapping(node, deep)


def _unique_json_object(pairs: list) -> dict:
    keys = [key for key, _ in pairs]
    for key in keys:
        if keys.count(key) > 1:
            raise _DuplicateKey(key)
    return dict(pairs)


def _read(path: Path):
    suffix = path.suffix.lower()
    if suffix not in (".json", ".yaml", ".yml"):
        raise LayoutFileError(path, f"unsupported file type {suffix or '(none)'!r}; use .json, .yaml or .yml")
    try:
        raw = path.read_bytes()
    except OSError as err:
        raise LayoutFileError(path, f"cannot read the file: {err.strerror or err}") from None
    if len(raw) > MAX_FILE_BYTES:
        raise LayoutFileError(path, f"is {len(raw):,} bytes; layout files are limited to {MAX_FILE_BYTES:,}")
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as err:
        raise LayoutFileError(
            path, f"is not UTF-8 text (byte 0x{raw[err.start]:02x} at offset {err.start})"
        ) from None
    try:
        if suffix == ".json":
            return json.loads(text, object_pairs_hook=_unique_json_object)
        return yaml.load(text, Loader=_UniqueKeyLoader)  # a SafeLoader subclass
    except _DuplicateKey as err:
        raise LayoutFileError(path, str(err), err.key) from None
    except json.JSONDecodeError as err:
        raise LayoutFileError(
            path, f"invalid JSON at line {err.lineno} column {err.colno}: {err.msg}"
        ) from None
    except yaml.YAMLError as err:
        mark = getattr(err, "problem_mark", None)
        where = f" at line {mark.line + 1} column {mark.column + 1}" if mark is not None else ""
        problem = getattr(err, "problem", None) or str(err)
        raise LayoutFileError(path, f"invalid YAML{where}: {problem}") from None
    except RecursionError:
        raise LayoutFileError(path, "is nested too deeply") from None


def parse_layout(data, source="<layout>") -> Workload:
    """Build a :class:`Workload` from the mapping of a layout file (``source`` names it in errors)."""
    if not isinstance(data, dict):
        raise LayoutFileError(source, f"the top level must be a mapping of fields, got {type(data).__name__}")
    unknown = [key for key in data if key not in TOP_LEVEL_FIELDS]
    if unknown:
        raise LayoutFileError(
            source, f"unknown field; known fields: {', '.join(TOP_LEVEL_FIELDS)}", str(unknown[0])
        )
    for key in ("grid", "selection"):
        if key not in data:
            raise LayoutFileError(source, "is missing (required)", key)
    sel = data["selection"]
    if not isinstance(sel, dict):
        raise LayoutFileError(
            source, f"must be a mapping with at least 'kind', got {type(sel).__name__}", "selection"
        )
    unknown = [key for key in sel if key not in SELECTION_FIELDS]
    if unknown:
        raise LayoutFileError(
            source, f"unknown field; known fields: {', '.join(SELECTION_FIELDS)}", f"selection.{unknown[0]}"
        )
    if "kind" not in sel:
        raise LayoutFileError(source, "is missing (required)", "selection.kind")
    kind = sel["kind"]
    if kind not in SELECTION_PARAMS:
        raise LayoutFileError(
            source, f"must be one of {', '.join(SELECTION_PARAMS)}, got {kind!r}", "selection.kind"
        )
    if kind != "svg2" and "tile" not in data:
        raise LayoutFileError(source, f"is missing (required for selection kind '{kind}')", "tile")
    for key in ("name", "description", "padding"):
        if key in data and not isinstance(data[key], str):
            raise LayoutFileError(source, f"must be a string, got {data[key]!r}", key)
    fields = dict(DEFAULTS)
    fields.update({k: v for k, v in data.items() if k != "selection"})
    fields.setdefault("name", Path(str(source)).stem or "layout")
    fields.setdefault("description", f"user layout from {Path(str(source)).name}")
    fields.setdefault("tile", None)
    try:
        return Workload(selection=Selection(**sel), source=str(source), **fields)
    except WorkloadError as err:
        raise LayoutFileError(source, err.detail, err.field) from None


def load_layout_file(path) -> Workload:
    """Read a JSON/YAML layout file into a :class:`Workload` (errors: :class:`LayoutFileError`)."""
    path = Path(path)
    return parse_layout(_read(path), source=path)
