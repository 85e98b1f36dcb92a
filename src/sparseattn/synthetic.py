"""Seeded synthetic Q/K features with spatial correlation, for data-dependent sparse selections.

When a user gives no Q/K, the VSA / SSTA / SVG2 builders score blocks with features from this
generator. Each head ``h`` of ``seed`` is drawn independently (``SeedSequence(seed, spawn_key=(h,))``),
so head ``h`` is the same whatever number of heads is asked for.

Model (per head; ``x`` = token position (t, h, w) in latent units, ``d`` = head_dim):

* a smooth random field from ``F`` random Fourier features with correlation length ``ell``:
  ``phi(x) = sqrt(2/F) * cos(omega @ x + b)``, ``omega ~ N(0, I / ell^2)`` ``[F, 3]``,
  ``b ~ U[0, 2 pi)``, ``ell ~ LogUniform[3, 12]`` tokens; ``phi(x)·phi(y) ≈ exp(-|x-y|^2 / (2 ell^2))``;
* a smooth *salience* field ``psi(x)`` (4 Fourier features, length ``2 ell``, unit variance) that
  makes some key regions attractive to every query (non-local selections);
* per-token noise ``eps_q(x), eps_k(x) ~ N(0, I_3)``.

The factors (rank ``r = min(16, d)``, ``F = r - 4``)::

    zq(x) = [ sqrt(L s) phi(x),  sqrt(S s),          sqrt(s / sqrt(3)) eps_q(x) ]
    zk(y) = [ sqrt(L s) phi(y),  sqrt(S s) psi(y),   sqrt(s / sqrt(3)) eps_k(y) ]      s = sqrt(d)

so the attention logit is ``q·k / sqrt(d) = L phi(x)·phi(y) + S psi(y) + eps_q·eps_k / sqrt(3)``
(local affinity of peak ``L ~ U[3, 8]``, salience of scale ``S ~ U[0.5, 3]``, unit-variance noise).
Full features are ``q = zq @ P``, ``k = zk @ P`` with ``P`` ``[r, d]`` a random matrix with
orthonormal rows, so dot products and distances of ``q``/``k`` equal those of ``zq``/``zk``: the
builders work on the cheap rank-``r`` factors and give the same selections as the full features.
"""

from __future__ import annotations

from contextlib import contextmanager

import numpy as np

NOISE_DIMS = 3
SALIENCE_FEATURES = 4
MAX_RANK = 16
MIN_DIM = 6
_FOURIER_CHUNK_TOKENS = 8192


class SyntheticError(ValueError):
    """A synthetic-generator argument is invalid; the message names it."""


def _check_int(name: str, value, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < minimum:
        raise SyntheticError(f"{name} must be an integer >= {minimum}, got {value!r}")
    return int(value)


def factor_rank(dim: int) -> int:
    """Rank ``r`` of the synthetic factors for head dimension ``dim``."""
    dim = _check_int("dim", dim, MIN_DIM)
    return min(MAX_RANK, dim)


def grid_positions(grid) -> np.ndarray:
    """float64 ``[T*H*W, 3]``: (t, h, w) of each token in raster order."""
    T, H, W = (int(g) for g in grid)
    t, h, w = np.meshgrid(np.arange(T), np.arange(H), np.arange(W), indexing="ij")
    return np.stack([t.ravel(), h.ravel(), w.ravel()], axis=1).astype(np.float64)


def _head_rngs(seed: int, head: int):
    ss = np.random.SeedSequence(int(seed), spawn_key=(int(head),))
    return [np.random.default_rng(s) for s in ss.spawn(3)]  # structure, q noise, k noise


def _fourier_chunks(where, omega: np.ndarray, phase: np.ndarray):
    """``sqrt(2/F) cos(omega @ x + phase)`` in pieces: yields ``(start, stop, float32 [stop - start, F])``
    for consecutive token ranges (each piece is only valid until the next one is asked for).

    ``where`` is a grid ``(T, H, W)`` (computed separably: one complex product per token and feature,
    no per-token cosine, a few frames at a time so the temporaries stay in cache) or positions
    ``[tokens, 3]`` (one piece).
    """
    F = omega.shape[0]
    amp = np.sqrt(2.0 / F)
    if not isinstance(where, tuple):
        out = (amp * np.cos(where @ omega.T + phase)).astype(np.float32)
        yield 0, out.shape[0], out
        return
    T, H, W = where
    et = np.exp(1j * (omega[:, 0, None] * np.arange(T) + phase[:, None])).astype(np.complex64)
    eh = np.exp(1j * omega[:, 1, None] * np.arange(H)).astype(np.complex64)
    ew = np.exp(1j * omega[:, 2, None] * np.arange(W)).astype(np.complex64)
    frames = max(1, _FOURIER_CHUNK_TOKENS // (H * W))
    buf = np.empty((frames * H * W, F), dtype=np.float32)
    for t0 in range(0, T, frames):
        t1 = min(T, t0 + frames)
        field = (et[:, t0:t1, None, None] * eh[:, None, :, None]) * ew[:, None, None, :]
        m = (t1 - t0) * H * W
        np.multiply(field.real.reshape(F, -1).T, amp, out=buf[:m])
        yield t0 * H * W, t1 * H * W, buf[:m]


def _as_where(grid=None, positions=None):
    if (grid is None) == (positions is None):
        raise SyntheticError("give exactly one of grid or positions")
    if grid is not None:
        try:
            g = tuple(int(v) for v in grid)
        except (TypeError, ValueError):
            raise SyntheticError(f"grid must be three positive integers, got {grid!r}") from None
        if len(g) != 3 or min(g) <= 0:
            raise SyntheticError(f"grid must be three positive integers, got {grid!r}")
        return g, g[0] * g[1] * g[2]
    pos = np.asarray(positions, dtype=np.float64)
    if pos.ndim != 2 or pos.shape[1] != 3 or pos.shape[0] == 0:
        raise SyntheticError(f"positions must be [tokens, 3], got shape {pos.shape}")
    return pos, pos.shape[0]


_reused: dict | None = None  # the factors drawn inside a reuse_factors() block


@contextmanager
def reuse_factors():
    """Within the block, :func:`synthetic_head_factors` of a grid draws each (head, grid, dim, seed)
    once and returns the same read-only arrays again (workloads on one latent share their
    features: the VSA and SVG2 built-ins at 720p). The arrays are freed when the block ends."""
    global _reused
    outer, _reused = _reused, {}
    try:
        yield
    finally:
        _reused = outer


def synthetic_head_factors(head: int, *, grid=None, positions=None, dim: int = 128, seed: int = 0):
    """Rank-``r`` factors ``(zq, zk)`` of one head, float32 ``[tokens, r]`` (see module docstring)."""
    r = factor_rank(dim)
    head = _check_int("head", head, 0)
    where, n = _as_where(grid, positions)
    key = (head, where, r, dim, int(seed)) if _reused is not None and isinstance(where, tuple) else None
    if key in (_reused or {}):
        return _reused[key]
    factors = _draw_factors(head, where, n, r, dim, seed)
    if key is not None:
        for z in factors:
            z.setflags(write=False)
        _reused[key] = factors
    return factors


def _draw_factors(head: int, where, n: int, r: int, dim: int, seed: int):
    rng, rng_q, rng_k = _head_rngs(seed, head)
    F = r - 1 - NOISE_DIMS
    ell = np.exp(rng.uniform(np.log(3.0), np.log(12.0)))
    local_logit = rng.uniform(3.0, 8.0)
    salience_logit = rng.uniform(0.5, 3.0)
    omega = rng.standard_normal((F, 3)) / ell
    phase = rng.uniform(0.0, 2 * np.pi, F)
    omega_s = rng.standard_normal((SALIENCE_FEATURES, 3)) / (2 * ell)
    phase_s = rng.uniform(0.0, 2 * np.pi, SALIENCE_FEATURES)

    s = np.sqrt(dim)
    noise_amp = np.float32(np.sqrt(s / np.sqrt(NOISE_DIMS)))
    local_amp = np.float32(np.sqrt(local_logit * s))
    salience_amp = np.float32(np.sqrt(salience_logit * s))
    zq = np.empty((n, r), dtype=np.float32)
    zk = np.empty((n, r), dtype=np.float32)
    # Piece by piece, so each piece is scaled and copied while it is in cache.
    for start, stop, phi in _fourier_chunks(where, omega, phase):
        np.multiply(phi, local_amp, out=zq[start:stop, :F])
        zk[start:stop, :F] = zq[start:stop, :F]
    for start, stop, f in _fourier_chunks(where, omega_s, phase_s):
        # psi = f.sum(axis=1) (unit variance), added term by term as np.sum does for so few terms
        # (fewer than 8: no pairwise split), about 10x faster than a reduction over a short axis.
        psi = f[:, 0] + f[:, 1]
        for c in range(2, SALIENCE_FEATURES):
            psi += f[:, c]
        np.multiply(psi, salience_amp, out=zk[start:stop, F])
    zq[:, F] = salience_amp
    np.multiply(rng_q.standard_normal((n, NOISE_DIMS), dtype=np.float32), noise_amp, out=zq[:, F + 1 :])
    np.multiply(rng_k.standard_normal((n, NOISE_DIMS), dtype=np.float32), noise_amp, out=zk[:, F + 1 :])
    return zq, zk


def synthetic_projection(head: int, dim: int = 128, seed: int = 0) -> np.ndarray:
    """float32 ``[r, dim]`` with orthonormal rows: lifts head ``head``'s factors to ``dim`` features."""
    r = factor_rank(dim)
    ss = np.random.SeedSequence(int(seed), spawn_key=(int(head), 1 << 20))
    g = np.random.default_rng(ss).standard_normal((dim, r))
    basis, _ = np.linalg.qr(g)
    return np.ascontiguousarray(basis.T, dtype=np.float32)


def synthetic_factors(heads: int, *, grid=None, positions=None, dim: int = 128, seed: int = 0):
    """Factors of all heads: ``(zq, zk)`` float32 ``[heads, tokens, r]``."""
    heads = _check_int("heads", heads, 1)
    pairs = [
        synthetic_head_factors(h, grid=grid, positions=positions, dim=dim, seed=seed) for h in range(heads)
    ]
    return np.stack([p[0] for p in pairs]), np.stack([p[1] for p in pairs])


def synthetic_qk(grid, heads: int, dim: int = 128, seed: int = 0):
    """Synthetic ``(q, k)``, float32 ``[heads, T*H*W, dim]`` in raster token order of ``grid``."""
    return _lift(heads, dim, seed, grid=grid)


def synthetic_qk_tokens(num_tokens: int, heads: int, dim: int = 128, seed: int = 0):
    """Synthetic ``(q, k)`` for a 1-D sequence of ``num_tokens`` (positions (0, 0, n)), ``[heads, n, dim]``."""
    n = _check_int("num_tokens", num_tokens, 1)
    pos = np.zeros((n, 3))
    pos[:, 2] = np.arange(n)
    return _lift(heads, dim, seed, positions=pos)


def _lift(heads, dim, seed, **where):
    heads = _check_int("heads", heads, 1)
    factor_rank(dim)
    qs, ks = [], []
    for h in range(heads):
        zq, zk = synthetic_head_factors(h, dim=dim, seed=seed, **where)
        p = synthetic_projection(h, dim, seed)
        qs.append(zq @ p)
        ks.append(zk @ p)
    return np.stack(qs), np.stack(ks)
