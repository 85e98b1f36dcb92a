"""Where the KPage forward's consumer loop waits for its P·V in the machine code (CPU; NOTES_kpage_fwd, v23).

Compiles the forward's default instantiations (or those of PageWeaver's union kernel) for sm_90a with the
NVRTC options, disassembles them and prints, per kernel and per consumer loop, how many ``MUFU.EX2`` (the
softmax's exponentials) lie between the S wait (``WARPGROUP.DEPBAR.LE gsb0, 0x1``) and the P·V wait
(``WARPGROUP.DEPBAR.LE gsb0, 0x0``), and how many come after it. At 3bf6fc4 every exponential comes after.

Needs ``nvcc`` and ``cuobjdump`` (on this repository's CPU machines ``cuobjdump`` comes from the
``nvidia-cuda-cuobjdump`` wheel: ``pip download --no-deps nvidia-cuda-cuobjdump``, unzip, put its ``bin`` on
``PATH``).

    PYTHONPATH=src python data/bench/experiments/sass_pv_wait.py [forward|pageweaver] [-DMACRO ...]
"""

from __future__ import annotations

import re
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]
KERNELS = ROOT / "kernels_cu"
FORWARD = (
    "paged_fwd_kernel<128, 128, false>",
    "paged_fwd_kernel<128, 128, true>",
    "paged_fwd_kernel<64, 128, false>",
    "paged_fwd_kernel<64, 128, true>",
    "paged_fwd_kernel<128, 64, false>",
)


def sass(source: str, kernels: tuple[str, ...], defines: list[str]) -> dict[str, list[str]]:
    """Instruction lists per kernel (mangled name) of ``source`` compiled with ``defines``."""
    with tempfile.TemporaryDirectory() as tmp:
        unit = Path(tmp) / "unit.cu"
        refs = ", ".join(f"(void*){k}" for k in kernels)
        unit.write_text(f'#include "{source}"\n' + (f"void* kernels[] = {{{refs}}};\n" if refs else ""))
        cubin = Path(tmp) / "unit.cubin"
        options = ["-std=c++17", "-arch=sm_90a", "--use_fast_math", "-cubin", f"-I{KERNELS}", *defines]
        subprocess.run(["nvcc", *options, "-o", str(cubin), str(unit)], check=True, capture_output=True)
        text = subprocess.run(
            ["cuobjdump", "-sass", str(cubin)], check=True, capture_output=True, text=True
        ).stdout
    functions: dict[str, list[str]] = {}
    name = None
    for line in text.splitlines():
        found = re.search(r"Function : (\S+)", line)
        if found:
            name = found.group(1)
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
    source, kernels = ("paged_fwd.cu", FORWARD) if which == "forward" else ("pw_union_fwd.cu", ())
    print(f"{source} {' '.join(defines) or '(default build)'}: MUFU.EX2 before / after the P·V wait")
    for mangled, instructions in sass(source, kernels, defines).items():
        name = (
            subprocess.run(["c++filt", mangled], check=True, capture_output=True, text=True)
            .stdout.strip()
            .split("(")[0]
        )
        for before, after in waits(instructions):
            print(f"  {name:40s} {len(instructions):5d} instructions: {before:3d} before, {after:3d} after")


if __name__ == "__main__":
    main(sys.argv[1:])
