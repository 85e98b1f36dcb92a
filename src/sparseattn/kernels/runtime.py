"""Loading ``kernels_cu/*.cu`` through ``cupy.RawModule`` (NVRTC, ``-arch=sm_90a``).

Sources are read from the repository's ``kernels_cu/`` folder (or ``$SPARSEATTN_KERNEL_DIR``).
Local ``#include "x.cuh"`` lines are inlined before compiling, so the code string — CuPy's cache
key — changes whenever a shared header changes. Modules compile lazily, once per process, with
explicit template instantiations (``name_expressions``).
"""

from __future__ import annotations

import functools
import hashlib
import os
import re
from pathlib import Path

#: NVRTC options for every kernel: Hopper with its arch-specific instructions (wgmma, setmaxnreg);
#: ``SPARSEATTN_LINEINFO=1`` adds source-line information, for ncu's source view (the same machine code).
NVRTC_OPTIONS = ("-std=c++17", "-arch=sm_90a", "--use_fast_math") + (
    ("-lineinfo",) if os.environ.get("SPARSEATTN_LINEINFO") == "1" else ()
)

_INCLUDE = re.compile(r'^\s*#\s*include\s+"([^"]+)"\s*$', re.MULTILINE)


def kernel_dir() -> Path:
    env = os.environ.get("SPARSEATTN_KERNEL_DIR")
    if env:
        return Path(env)
    return Path(__file__).resolve().parents[3] / "kernels_cu"


def kernel_sources() -> list[Path]:
    """Every ``.cu`` file of the kernel folder (what the compile check builds)."""
    return sorted(kernel_dir().glob("*.cu"))


def preprocess(source: str | Path, _seen: frozenset = frozenset()) -> str:
    """The source with local ``#include "…"`` files inlined (each once), as NVRTC will see it."""
    path = Path(source)
    if not path.is_absolute():
        path = kernel_dir() / path
    if not path.exists():
        raise FileNotFoundError(f"kernel source {path} not found (set SPARSEATTN_KERNEL_DIR?)")
    text = path.read_text()
    seen = set(_seen) | {path.name}

    def inline(match: re.Match) -> str:
        name = match.group(1)
        if name in seen:
            return f"// (already included: {name})"
        seen.add(name)
        return f"// ---- begin {name}\n{preprocess(path.parent / name, frozenset(seen))}\n// ---- end {name}"

    return _INCLUDE.sub(inline, text)


def source_hash(source: str | Path) -> str:
    """Short hash of the preprocessed source: the part of the cache key that follows the headers."""
    return hashlib.sha256(preprocess(source).encode()).hexdigest()[:16]


@functools.cache
def _module(source: str, name_expressions: tuple[str, ...], options: tuple[str, ...], digest: str):
    import cupy

    code = preprocess(source)
    return cupy.RawModule(code=code, options=options, name_expressions=name_expressions)


def get_module(source: str, name_expressions, options=NVRTC_OPTIONS):
    """The compiled ``cupy.RawModule`` of ``kernels_cu/<source>`` with the given instantiations."""
    return _module(source, tuple(name_expressions), tuple(options), source_hash(source))


def get_function(source: str, name_expression: str, name_expressions=None, options=NVRTC_OPTIONS):
    """One kernel of a module; ``name_expressions`` lists every instantiation the module compiles."""
    names = tuple(name_expressions) if name_expressions is not None else (name_expression,)
    if name_expression not in names:
        raise ValueError(f"{name_expression!r} is not among the module's name_expressions {names}")
    return get_module(source, names, options).get_function(name_expression)
