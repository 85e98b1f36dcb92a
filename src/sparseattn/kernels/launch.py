"""What every kernel launch shares: compiled-function lookup, per-device plan arrays, device facts,
and torch interop (torch CUDA tensors in, torch tensors out, on torch's current stream, no copies).

Lookups are dictionary hits after the first call: a source file is read and hashed once per process
and kernel (see :mod:`.runtime`), a plan's arrays are uploaded once per device.
"""

from __future__ import annotations

import contextlib
import ctypes
import weakref

import numpy as np

from . import runtime
from .validate import KernelTypeError

_FUNCTIONS: dict = {}
_SM_COUNT: dict = {}
_RUNS_SM90: dict = {}
_DEVICE_ARRAYS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def variants_from_env(variable: str, allowed: tuple[str, ...]) -> tuple[str, ...]:
    """The compile-time variants an environment variable selects for a process (comma-separated names
    of ``allowed``), sorted; an unknown name raises, naming the variable."""
    import os

    from .validate import KernelValueError

    names = tuple(sorted({n for n in os.environ.get(variable, "").split(",") if n}))
    bad = [n for n in names if n not in allowed]
    if bad:
        raise KernelValueError(f"{variable}: unknown variant {bad[0]!r}; choose from {allowed}")
    return names


def check_variant_needs(defines: tuple[str, ...], needs: dict, source: str) -> tuple[str, ...]:
    """``defines`` if every variant's companions (``needs[name]``) are there; else a KernelValueError naming
    ``source``."""
    from .validate import KernelValueError

    for name in defines:
        missing = [n for n in needs.get(name, ()) if n not in defines]
        if missing:
            raise KernelValueError(f"{source}: {name} needs {', '.join(missing)} in the same build")
    return defines


def function(source: str, name: str, name_expressions: tuple[str, ...], defines: tuple[str, ...] = ()):
    """The compiled kernel ``name`` of ``kernels_cu/<source>`` (compiled once per process); ``defines``
    are preprocessor macros (``"NAME"`` or ``"NAME=VALUE"``) for a kernel's compile-time variants."""
    key = (source, name, name_expressions, defines)
    fn = _FUNCTIONS.get(key)
    if fn is None:
        options = runtime.NVRTC_OPTIONS + tuple(f"-D{d}" for d in defines)
        fn = _FUNCTIONS[key] = runtime.get_function(source, name, name_expressions, options)
    return fn


def prepare(fn, smem_bytes: int):
    """Raise the kernel's dynamic shared-memory limit to ``smem_bytes`` (once)."""
    fn.max_dynamic_shared_size_bytes = max(fn.max_dynamic_shared_size_bytes, smem_bytes)
    return fn


def runs_sm90(x) -> bool:
    """Whether the sm_90a kernels can run on ``x``'s device: a CUDA tensor on an sm_90 GPU, CuPy
    importable (known once per device)."""
    if not getattr(x, "is_cuda", False):
        return False
    index = x.device.index
    ok = _RUNS_SM90.get(index)
    if ok is None:
        import importlib.util

        import torch

        ok = _RUNS_SM90[index] = importlib.util.find_spec(
            "cupy"
        ) is not None and torch.cuda.get_device_capability(x.device) == (9, 0)
    return ok


def sm_count(device: int) -> int:
    n = _SM_COUNT.get(device)
    if n is None:
        import cupy

        n = _SM_COUNT[device] = int(cupy.cuda.Device(device).attributes["MultiProcessorCount"])
    return n


def device_arrays(owner, device: int, build) -> dict:
    """``build()`` (a dict of numpy arrays) uploaded to ``device``, cached as long as ``owner`` lives."""
    per_owner = _DEVICE_ARRAYS.setdefault(owner, {})
    arrays = per_owner.get(device)
    if arrays is None:
        import cupy

        with cupy.cuda.Device(device):
            arrays = per_owner[device] = {k: cupy.asarray(v) for k, v in build().items()}
    return arrays


# ---- packed launches -------------------------------------------------------------------------------

_CTYPES = {
    np.dtype(np.int32): ctypes.c_int32,
    np.dtype(np.uint32): ctypes.c_uint32,
    np.dtype(np.int64): ctypes.c_int64,
    np.dtype(np.uint64): ctypes.c_uint64,
    np.dtype(np.float32): ctypes.c_float,
}


def pack_arguments(args) -> tuple[list, object, list]:
    """``(slots, params, held)``: one ctypes value per kernel argument (numpy scalars of int32, uint32,
    int64, uint64 (pointers) or float32; arrays with a ``data.ptr`` (CuPy) pass their pointer; objects with
    a ``kernel_argument()`` (:class:`.tensor_map.TensorMap`) pass the bytes of its ctypes value), the
    ``void*[]`` of their addresses that ``cuLaunchKernel`` reads, and the arrays whose memory the pointers
    name (kept alive)."""
    slots, held = [], []
    for i, a in enumerate(args):
        if hasattr(a, "kernel_argument"):  # a by-value struct (a tensor map): its ctypes bytes
            slots.append(a.kernel_argument())
            held.append(a)
            continue
        data = getattr(a, "data", None)
        if hasattr(data, "ptr"):
            slots.append(ctypes.c_uint64(int(data.ptr)))
            held.append(a)
            continue
        kind = _CTYPES.get(getattr(a, "dtype", None)) if isinstance(a, np.generic) else None
        if kind is None:
            raise KernelTypeError(
                f"kernel argument {i} must be a numpy int32/uint32/int64/uint64/float32 scalar or a device "
                f"array, got {type(a).__name__}"
            )
        slots.append(kind(a.item()))
    params = (ctypes.c_void_p * max(len(slots), 1))(*(ctypes.addressof(v) for v in slots))
    return slots, params, held


class PackedLaunch:
    """One kernel launch with its arguments packed once: a call sets the arguments at positions ``bound``
    (default: the first ones; device pointers or integers) and goes to ``cuLaunchKernel`` directly,
    without CuPy's per-argument conversion (a few microseconds of host time instead of tens)."""

    __slots__ = ("address", "block", "bound", "f", "fn", "grid", "held", "params", "slots", "smem")

    def __init__(self, fn, grid, block, args, smem: int = 0, bound=None):
        self.fn = fn  # a cupy RawKernel (its compiled Function is .kernel) or a Function
        self.f = int(getattr(fn, "kernel", fn).ptr)
        self.grid = tuple(int(x) for x in grid) + (1,) * (3 - len(grid))
        self.block = tuple(int(x) for x in block) + (1,) * (3 - len(block))
        self.smem = int(smem)
        self.slots, self.params, self.held = pack_arguments(args)
        self.address = ctypes.addressof(self.params)
        self.bound = tuple(range(len(self.slots))) if bound is None else tuple(bound)

    def __call__(self, stream: int, *values) -> None:
        from cupy.cuda import driver

        slots, bound = self.slots, self.bound
        for i, value in enumerate(values):
            slots[bound[i]].value = value
        gx, gy, gz = self.grid
        bx, by, bz = self.block
        driver.launchKernel(self.f, gx, gy, gz, bx, by, bz, self.smem, stream, self.address, 0)


def side_stream(device: int):
    """The non-blocking CuPy stream of :func:`side_by_side` on ``device`` (made once)."""
    import cupy

    side = _SIDE_STREAMS.get(device)
    if side is None:
        side = _SIDE_STREAMS[device] = cupy.cuda.Stream(non_blocking=True)
    return side


def _capturing(stream: int) -> bool:
    import cupy

    try:
        return bool(cupy.cuda.runtime.streamIsCapturing(stream))
    except AttributeError:  # a CuPy without the query: assume an eager stream
        return False


_NEG_INF: dict = {}  # device -> float32 -inf buffers (every one kept: captured graphs may read it)


def fill_neg_inf(ptr: int, count: int, stream: int, device: int) -> None:
    """Write ``count`` float32 ``-inf`` at ``ptr`` on ``stream``: one device-to-device copy from a constant
    buffer kept per device (capturable in a CUDA graph once the buffer exists)."""
    import cupy

    bufs = _NEG_INF.setdefault(device, [])
    if not bufs or bufs[-1].size < count:
        if _capturing(stream):  # no synchronisation now: fill in place
            mem = cupy.cuda.UnownedMemory(ptr, 4 * count, None, device)
            out = cupy.ndarray((count,), cupy.float32, memptr=cupy.cuda.MemoryPointer(mem, 0))
            with cupy.cuda.ExternalStream(stream):
                out.fill(-np.inf)
            return
        with cupy.cuda.Device(device):
            bufs.append(cupy.full(max(count, 1 << 16), -np.inf, dtype=cupy.float32))
            cupy.cuda.runtime.deviceSynchronize()  # filled before any stream reads it
    src = bufs[-1].data.ptr
    cupy.cuda.runtime.memcpyAsync(ptr, src, 4 * count, cupy.cuda.runtime.memcpyDeviceToDevice, stream)


# ---- torch interop ----------------------------------------------------------------------------------


def is_torch_tensor(x) -> bool:
    """True for a torch.Tensor (checked without importing torch for other objects)."""
    if not type(x).__module__.startswith("torch"):
        return False
    import torch

    return isinstance(x, torch.Tensor)


def torch_to_cupy(name: str, x):
    """A CuPy ``uint16`` (bf16 bits) or ``float32`` view of a torch CUDA tensor, sharing its memory."""
    import cupy
    import torch

    if not x.is_cuda:
        raise KernelTypeError(f"{name} must be a CUDA tensor, got a tensor on {x.device}")
    if x.dtype == torch.bfloat16:
        return cupy.from_dlpack(x.detach().view(torch.int16)).view(cupy.uint16)
    if x.dtype == torch.float32:
        return cupy.from_dlpack(x.detach())
    raise KernelTypeError(f"{name} must have dtype torch.bfloat16 (float32 for lse), got {x.dtype}")


def torch_views(tensors: dict, out, out_names: tuple[str, ...], out_like: str) -> tuple[list, list]:
    """CuPy views of named torch inputs and of the caller's outputs (``out``, a tuple of torch tensors
    named ``out_names``); every input must be a torch tensor. Returns ``(inputs, outputs)``."""
    for name, x in tensors.items():
        if not is_torch_tensor(x):
            raise KernelTypeError(f"{name} must be a torch tensor like q, got {type(x).__name__}")
    if not isinstance(out, (tuple, list)) or len(out) != len(out_names) or not all(map(is_torch_tensor, out)):
        raise KernelTypeError(f"out must be a tuple {out_like} of torch tensors")
    inputs = [torch_to_cupy(name, x) for name, x in tensors.items()]
    return inputs, [torch_to_cupy(name, x) for name, x in zip(out_names, out)]


def torch_stream_ptr(device_index: int) -> int:
    """The raw handle of torch's current CUDA stream on ``device_index`` (torch's C entry point: a fraction
    of ``torch.cuda.current_stream()``'s host time)."""
    import torch

    raw = getattr(torch._C, "_cuda_getCurrentRawStream", None)
    if raw is not None:
        return int(raw(device_index))
    return torch.cuda.current_stream(device_index).cuda_stream


_EXTERNAL_STREAMS: dict = {}


def torch_stream():
    """CuPy handle of torch's current CUDA stream (use as a context manager around launches); one handle
    per torch stream, made once."""
    import cupy
    import torch

    stream = torch.cuda.current_stream()
    key = (stream.device_index, stream.cuda_stream)
    handle = _EXTERNAL_STREAMS.get(key)
    if handle is None:
        from_external = getattr(
            cupy.cuda.Stream, "from_external", None
        )  # CuPy >= 14 (ExternalStream deprecated)
        if from_external is not None and hasattr(stream, "__cuda_stream__"):
            handle = from_external(stream)
        else:
            handle = cupy.cuda.ExternalStream(stream.cuda_stream)
        _EXTERNAL_STREAMS[key] = handle
    return handle


def _torch_malloc(size: int):
    """A CuPy allocation served by torch's caching allocator on the current device (and stream): it is
    then one of torch's blocks, which CUDA-graph capture and torch's memory accounting see."""
    import cupy
    import torch

    device = cupy.cuda.runtime.getDevice()
    block = torch.empty(max(int(size), 1), dtype=torch.uint8, device=f"cuda:{device}")
    return cupy.cuda.MemoryPointer(cupy.cuda.UnownedMemory(block.data_ptr(), int(size), block, device), 0)


@contextlib.contextmanager
def torch_context():
    """Launch on torch's current stream with CuPy's temporaries allocated by torch: what a torch call
    needs to run inside ``torch.cuda.graph`` capture (no allocation escapes the graph's memory pool)."""
    import cupy

    with torch_stream(), cupy.cuda.using_allocator(_torch_malloc):
        yield


_SIDE_STREAMS: dict[int, object] = {}


def side_by_side(launches) -> None:
    """Run ``launches`` (callables that launch kernels on the current stream) concurrently: all but the
    last on a side stream, started first, the last on the current stream, which then waits for the side
    stream. The side stream starts after the work queued so far. CTAs start in launch order, so
    launches put first (smaller ones) take SMs first and the last one fills the SMs they leave: one
    launch's long items no longer run alone at its end while the other SMs idle.

    For launches that write disjoint outputs or add with atomics (dQ)."""
    import cupy

    launches = list(launches)
    if len(launches) < 2:
        for go in launches:
            go()
        return
    current = cupy.cuda.get_current_stream()
    side = side_stream(cupy.cuda.runtime.getDevice())
    side.wait_event(current.record())
    with side:
        for go in launches[:-1]:
            go()
    launches[-1]()
    current.wait_event(side.record())
