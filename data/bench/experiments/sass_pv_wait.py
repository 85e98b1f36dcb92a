"""Where the KPage forward's consumer loop waits for its P·V in the machine code (CPU; NOTES_kpage_fwd, v23).

Compiles the forward's instantiations (``forward.NAME_EXPRESSIONS``), or PageWeaver's union kernels, with
the project's NVRTC and options (:mod:`sparseattn.kernels.compile_check`), disassembles the cubin and prints,
per kernel and per consumer loop, how many ``MUFU.EX2`` (the softmax's exponentials) lie between the S wait
(``WARPGROUP.DEPBAR.LE gsb0, 0x1``) and the P·V wait (``WARPGROUP.DEPBAR.LE gsb0, 0x0``), and how many come
after it. At 3bf6fc4 every exponential comes after.

Needs ``cuobjdump`` on ``PATH`` (on this repository's CPU machines from the ``nvidia-cuda-cuobjdump`` wheel:
``pip download --no-deps nvidia-cuda-cuobjdump``, unzip, put its ``bin`` on ``PATH``).

    PYTHONPATH=src python data/bench/experiments/sass_pv_wait.py [forward|pageweaver] [-DMACRO ...]
"""

from __future__ import annotations

import re
import subprocess
import sys
import tempfile
from pathlib import Path

from sparseattn.kernels import compile_check, forward, pageweaver, runtime


def sass(source: str, kernels: tuple[str, ...], defines: list[str]) -> dict[str, list[str]]:
    """Instruction lists per kernel (its name expression) of ``source`` compiled with ``defines``."""
    nvrtc = compile_check._Nvrtc(compile_check.find_nvrtc())
    options = compile_check.compile_options(compile_check.find_cuda_include()) + tuple(defines)
    ok, log, cubin, lowered = nvrtc.compile(runtime.preprocess(source), source, options, kernels)
    if not ok:
        raise SystemExit(log)
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "unit.cubin"
        path.write_bytes(cubin)
        text = subprocess.run(
            ["cuobjdump", "-sass", str(path)], check=True, capture_output=True, text=True
        ).stdout
    by_lowered = {name: expr for expr, name in lowered.items()}
    functions: dict[str, list[str]] = {}
    name = None
    for line in text.splitlines():
        found = re.search(r"Function : (\S+)", line)
        if found:
            name = by_lowered.get(found.group(1), found.group(1))
            functions[name] = []
            continue
        found = re.match(r"\s+/\*[0-9a-f]{4}\*/\s*(.*?)\s*;", line)
        if found and name:
            functions[name].append(found.group(1))
    return functions


def waits(instructions: list[str]) -> list[tuple[int, int]]:
    """Per S wait: (exponentials before the next P·V wait, exponentials in the 400 instructions after it)."""
    out = []
    for i, ins in enumerate(instructions):
        if "DEPBAR.LE gsb0, 0x1" not in ins:
            continue
        j = next(k for k in range(i + 1, len(instructions)) if "DEPBAR.LE gsb0, 0x0" in instructions[k])
        before = sum("MUFU.EX2" in x for x in instructions[i:j])
        after = sum("MUFU.EX2" in x for x in instructions[j : j + 400])
        out.append((before, after))
    return out


def main(argv: list[str]) -> None:
    which = argv[0] if argv and not argv[0].startswith("-") else "forward"
    defines = [a for a in argv if a.startswith("-D")]
    source, kernels = (
        (forward.SOURCE, forward.NAME_EXPRESSIONS)
        if which == "forward"
        else (pageweaver.SOURCE, pageweaver.NAME_EXPRESSIONS)
    )
    print(f"{source} {' '.join(defines) or '(default build)'}: MUFU.EX2 before / after the P·V wait")
    for name, instructions in sass(source, kernels, defines).items():
        for before, after in waits(instructions):
            print(f"  {name:40s} {len(instructions):5d} instructions: {before:3d} before, {after:3d} after")


if __name__ == "__main__":
    main(sys.argv[1:])
