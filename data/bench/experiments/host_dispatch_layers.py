"""Host time of torch's dispatch layers for an operator with the KPage forward's schema, on CPU tensors
(an implementation that returns preallocated outputs, so only the dispatch is timed): the bare
implementation, a one-tensor no-op operator, the schema without and with ``register_autograd``, and with
an input that requires grad. Output: ``host_dispatch_layers_cpu_20261205.txt`` (NOTES_host_path v6).

    python data/bench/experiments/host_dispatch_layers.py
"""

import time

import torch

SCHEMA = "(Tensor q, Tensor k, Tensor v, int graph, str route, float scale, bool deterministic) -> (Tensor, Tensor)"
lib = torch.library.Library("dispatch_layers", "DEF")
lib.define("plain" + SCHEMA)
lib.define("with_autograd" + SCHEMA)
lib.define("noop(Tensor q) -> Tensor")
O, L = torch.zeros(1), torch.zeros(1)


def impl(q, k, v, graph, route, scale, deterministic):
    return O, L


torch.library.impl("dispatch_layers::plain", "CPU", impl)
torch.library.impl("dispatch_layers::with_autograd", "CPU", impl)
torch.library.impl("dispatch_layers::noop", "CPU", lambda q: O)


def _setup(ctx, inputs, output):
    ctx.seen = True


def _backward(ctx, do, dlse):
    return (None,) * 7


torch.library.register_autograd("dispatch_layers::with_autograd", _backward, setup_context=_setup)


def per_call_us(fn, calls: int = 20000) -> float:
    for _ in range(200):
        fn()
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    return (time.perf_counter() - start) / calls * 1e6


def main() -> None:
    q, k, v = (torch.zeros(2, 2) for _ in range(3))
    ops = torch.ops.dispatch_layers
    args = (1, "auto", 0.1, False)
    rows = [
        ("the implementation called directly", lambda: impl(q, k, v, *args)),
        ("a no-op operator (one tensor)", lambda: ops.noop(q)),
        ("the schema, no autograd registered", lambda: ops.plain.default(q, k, v, *args)),
        ("the schema with register_autograd", lambda: ops.with_autograd.default(q, k, v, *args)),
    ]
    for name, fn in rows:
        print(f"{name:45s} {per_call_us(fn):6.1f} us")
    with torch.no_grad():
        t = per_call_us(lambda: ops.with_autograd.default(q, k, v, *args))
    print(f"{'the same under torch.no_grad()':45s} {t:6.1f} us")
    qg = q.clone().requires_grad_()
    t = per_call_us(lambda: ops.with_autograd.default(qg, k, v, *args))
    print(f"{'the same, q requires grad':45s} {t:6.1f} us")


if __name__ == "__main__":
    main()
