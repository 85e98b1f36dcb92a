"""A device planner call recorded once per shape and replayed: the launches with their arguments packed.

:meth:`.device.DevicePlanner.plan` launches about fifteen kernels per call, through CuPy, whose conversion of
their arguments (up to 47 for ``plan_items``) cost most of a dynamic call's host time. Every argument but
the call's own memory and selection is fixed by the planner and the call's shape (batch · heads, selection
width and form, device, the launchers' settings), so the first call of a shape runs with the launchers
recording (:data:`sparseattn.kernels.planner.RECORD`) and later calls replay the records: each launch packed
once (:class:`sparseattn.kernels.launch.PackedLaunch`), its pointers into the call's buffers and to the
selection set per call. The same launches in the same order on the same streams, so the same plans.

A recorded argument is rebound when it is a device pointer (a ``numpy.uint64`` or an array's ``data.ptr``)
inside the recorded call's buffers (replayed at the same offset in the new call's) or equal to one of the
recorded selection's pointers (replayed as the new selection's); everything else (the templates' tables,
sizes, scalars) is fixed.

The record is a module-level list: a first call of a shape must not run while another thread launches
through the same launchers (their launches would enter the record); replays share nothing.
"""

from __future__ import annotations

import numpy as np

#: Phases of a call: what runs first on the current stream, then the backward's and the forward's chains
#: (side by side when the planner overlaps them).
PHASES = ("top", "backward", "forward")


def pointer_of(value) -> int | None:
    """A launch argument's device pointer (a ``numpy.uint64`` or an array's ``data.ptr``), else None."""
    if isinstance(value, np.uint64):
        return int(value)
    data = getattr(value, "data", None)
    if hasattr(data, "ptr"):
        return int(data.ptr)
    return None


class PlanRecipe:
    """One recorded call. ``records``: per phase, the launchers' records (:data:`~sparseattn.kernels.planner.RECORD`);
    ``arena``: the recorded call's buffers (:class:`.device.Arena`); ``selection``: name -> the recorded
    selection's pointers; ``plans``: the recorded plans without memory (:meth:`.device.DevicePlans.in_arena`
    moves them)."""

    def __init__(self, records: dict, arena, selection: dict, plans):
        self.plans = plans
        self.phases = {
            name: [self._compiled(op, arena, selection) for op in ops] for name, ops in records.items()
        }

    @staticmethod
    def _reference(value, arena, selection: dict):
        """``("arena", offset)``, ``("selection", name)`` or None (a fixed argument)."""
        pointer = pointer_of(value)
        if pointer is None or pointer == 0:
            return None
        offset = arena.offset_of(pointer)
        if offset is not None:
            return ("arena", offset)
        for name, recorded in selection.items():
            if pointer == recorded:
                return ("selection", name)
        return None

    def _compiled(self, op, arena, selection: dict):
        from ..kernels import launch

        if op[0] == "launch":
            _, fn, grid, block, args, smem = op
            slots, bound, refs = [], [], []
            for i, value in enumerate(args):
                ref = self._reference(value, arena, selection)
                if ref is None:
                    slots.append(value)
                else:
                    slots.append(np.uint64(0))
                    bound.append(i)
                    refs.append(ref)
            return ("launch", launch.PackedLaunch(fn, grid, block, slots, smem, bound), refs)
        pointers = op[1:-1]  # memset: (pointer,), copy: (dst, src)
        refs = [self._reference(p, arena, selection) or ("fixed", int(p)) for p in pointers]
        return (op[0], refs, op[-1])

    @staticmethod
    def _value(ref, base: int, selection: dict) -> int:
        kind, what = ref
        if kind == "arena":
            return base + what
        if kind == "selection":
            return selection[what]
        return what

    def replay(self, phase: str, base: int, selection: dict) -> None:
        """Issue ``phase``'s records on the current stream over the buffers at ``base`` and the selection's
        pointers (name -> pointer)."""
        import cupy

        from ..kernels import planner

        stream = cupy.cuda.get_current_stream().ptr
        for kind, *rest in self.phases.get(phase, ()):
            if kind == "launch":
                packed, refs = rest
                packed(stream, *(self._value(r, base, selection) for r in refs))
            else:  # memset_zero(pointer, bytes) or copy(dst, src, bytes), as recorded
                refs, nbytes = rest
                call = planner.memset_zero if kind == "memset" else planner.copy
                call(*(self._value(r, base, selection) for r in refs), nbytes)
