"""PageWeaver FP8 (e4m3) K/V cache: quantisation error bound, scales, padding, bf16 dequantisation,
and the cache checks."""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest

from sparseattn.pageweaver.fp8 import (
    E4M3,
    E4M3_MAX,
    Fp8CacheError,
    Fp8KVCache,
    check_cache,
    dequantize,
    quantize_kv,
    random_cache,
)

#: e4m3 keeps 3 mantissa bits: rounding to nearest moves a normal value by at most half an ulp,
#: 2^-4 of its binade's lower bound, so ≤ 2^-4·|x|; in the subnormal range (|x/scale| < 2^-6) the
#: step is 2^-9, so the error is ≤ 2^-10 in scaled units = scale·2^-10.
REL_BOUND = 2.0**-4
SUBNORMAL_ABS = 2.0**-10


def _wide_range(rng, shape):
    """float32 values spanning ~2^-20 … 2^5 (normal and subnormal e4m3 after scaling)."""
    return (rng.standard_normal(shape) * np.exp2(rng.uniform(-20, 4, shape))).astype(np.float32)


def _per_row(scale, page_size, rows):
    return np.repeat(scale.astype(np.float64), page_size, axis=1)[:, :rows, None]


@pytest.mark.parametrize(
    "heads,length,dim,page_size",
    [(2, 100, 16, 16), (1, 64, 8, 64), (3, 300, 32, 128), (2, 1, 4, 16)],
    ids=["partial-page", "one-full-page", "P128", "one-token"],
)
def test_round_trip_error_bound(heads, length, dim, page_size):
    rng = np.random.default_rng(length)
    x = _wide_range(rng, (heads, length, dim))
    bits, scale = quantize_kv(x, page_size)
    pages = -(-length // page_size)
    assert bits.dtype == np.uint8 and bits.shape == (heads, pages * page_size, dim)
    assert scale.dtype == np.float32 and scale.shape == (heads, pages)
    deq = dequantize(bits, scale, page_size)
    assert deq.dtype == np.float64 and deq.shape == bits.shape
    s = _per_row(scale, page_size, length)
    err = np.abs(deq[:, :length] - x)
    assert (err <= REL_BOUND * np.abs(x) + SUBNORMAL_ABS * s).all()
    # the page's largest magnitude maps to ±448 and comes back to float32 rounding
    amax = (
        np.abs(np.pad(x, ((0, 0), (0, pages * page_size - length), (0, 0)))).reshape(heads, pages, -1).max(2)
    )
    # the smallest power of two with amax / scale <= 448: amax lands in (224, 448]
    assert (np.log2(scale) == np.round(np.log2(scale))).all()
    ratio = amax / scale
    assert ((ratio > 224) & (ratio <= E4M3_MAX) | (amax == 0)).all()
    top = np.abs(deq).reshape(heads, pages, -1).max(axis=2)
    np.testing.assert_allclose(top, amax, rtol=REL_BOUND)


def test_round_to_nearest_even():
    """Page amax 448 → scale 1: midpoints go to the even neighbour, normal and subnormal."""
    x = np.array([448, 1.0625, 1.1875, 17, 19, 2.0**-10, 3 * 2.0**-10, -1.0625], np.float32)
    bits, scale = quantize_kv(x[None, :, None], 16)
    assert scale.tolist() == [[1.0]]
    got = dequantize(bits, scale, 16)[0, : x.size, 0]
    assert got.tolist() == [448, 1.0, 1.25, 16, 20, 0.0, 2.0**-8, -1.0]


def test_zero_page_gets_scale_one_and_padding_is_zero():
    x = np.ones((2, 40, 4), np.float32)
    x[:, 16:32] = 0.0  # page 1 all zero
    x[1, 3, 2] = -7.0
    bits, scale = quantize_kv(x, 16)
    assert scale[:, 1].tolist() == [1.0, 1.0]
    assert scale[0, 0] == np.float32(2.0**-8) and scale[1, 0] == np.float32(7 / 448)  # 7/448 = 2^-6
    assert not bits[:, 16:32].any()
    assert bits.shape[1] == 48 and not bits[:, 40:].any()  # rows past context: e4m3 zero bits
    assert not dequantize(bits, scale, 16)[:, 40:].any()


def test_float32_subnormal_page_keeps_a_positive_scale():
    """amax / 448 underflows to 0 in float32 for tiny pages; the scale stays positive, no NaN bits."""
    x = np.full((1, 4, 2), 1e-44, np.float32)
    bits, scale = quantize_kv(x, 16)
    assert (scale > 0).all() and np.isfinite(scale).all()
    assert not np.isnan(bits.view(E4M3).astype(np.float32)).any()
    deq = dequantize(bits, scale, 16)
    assert (np.abs(deq[:, :4] - x) <= SUBNORMAL_ABS * scale[0, 0]).all()
    Fp8KVCache(bits, bits, scale, scale, 16, 4)


def test_dequantize_bf16_is_one_float32_product_rounded_once():
    rng = np.random.default_rng(3)
    cache = random_cache(rng, kv_heads=2, context=150, head_dim=16, page_size=64)
    for bits, scale in ((cache.k, cache.k_scale), (cache.v, cache.v_scale)):
        product = (
            bits.view(ml_dtypes.float8_e4m3fn).astype(np.float32) * np.repeat(scale, 64, axis=1)[:, :, None]
        )
        want = product.astype(ml_dtypes.bfloat16).astype(np.float64)
        got = dequantize(bits, scale, 64, round_bf16=True)
        np.testing.assert_array_equal(got, want)
        assert got.dtype == np.float64
        exact = dequantize(bits, scale, 64)
        np.testing.assert_array_equal(exact, bits.view(E4M3).astype(np.float64) * _per_row(scale, 64, 192))
        np.testing.assert_array_equal(got, exact)  # power-of-two scales: e4m3 · scale is exact in bf16
        odd = (scale * np.float32(1.3)).astype(np.float32)  # any other scale: one rounding to bf16
        got, exact = dequantize(bits, odd, 64, round_bf16=True), dequantize(bits, odd, 64)
        assert np.abs(got - exact).max() > 0
        assert (np.abs(got - exact) <= 2.0**-8 * np.abs(exact)).all()  # bf16: 8 significant bits


def test_random_cache_and_dequantized():
    cache = random_cache(np.random.default_rng(0), kv_heads=3, context=70, head_dim=8, page_size=32)
    assert (cache.kv_heads, cache.head_dim, cache.num_pages) == (3, 8, 3)
    k, v = cache.dequantized()
    assert k.shape == v.shape == (3, 96, 8)
    assert not k[:, 70:].any() and not v[:, 70:].any()
    kb, _ = cache.dequantized(round_bf16=True)
    np.testing.assert_array_equal(kb, dequantize(cache.k, cache.k_scale, 32, round_bf16=True))


def test_cache_accepts_float8_dtype():
    bits, scale = quantize_kv(np.ones((1, 16, 4), np.float32), 16)
    Fp8KVCache(bits.view(E4M3), bits.view(E4M3), scale, scale, 16, 16)


def _cache_args():
    bits, scale = quantize_kv(np.ones((2, 40, 4), np.float32), 16)  # 3 pages, 48 rows
    return dict(k=bits, v=bits.copy(), k_scale=scale, v_scale=scale.copy(), page_size=16, context=40)


BAD_CACHES = [
    pytest.param(dict(k=np.zeros((2, 48, 4), np.float32)), r"^k must hold e4m3", id="k-float32"),
    pytest.param(dict(v=np.zeros((2, 48, 4), np.int8)), r"^v must hold e4m3", id="v-int8"),
    pytest.param(dict(k=[[[0]]]), r"^k must hold e4m3", id="k-list"),
    pytest.param(dict(k=np.zeros((2, 40, 4), np.uint8)), r"^k must have shape .*48", id="k-unpadded"),
    pytest.param(dict(v=np.zeros((48, 4), np.uint8)), r"^v must have shape", id="v-2d"),
    pytest.param(dict(v=np.zeros((2, 48, 8), np.uint8)), r"^v must have k's shape", id="v-head-dim"),
    pytest.param(dict(k_scale=np.ones((2, 3))), r"^k_scale must be float32", id="k-scale-float64"),
    pytest.param(dict(v_scale=np.ones((2, 2), np.float32)), r"^v_scale must have shape", id="v-scale-pages"),
    pytest.param(
        dict(k_scale=np.zeros((2, 3), np.float32)), r"^k_scale must be finite and positive", id="zero"
    ),
    pytest.param(
        dict(v_scale=-np.ones((2, 3), np.float32)), r"^v_scale must be finite and positive", id="neg"
    ),
    pytest.param(dict(v_scale=np.full((2, 3), np.nan, np.float32)), r"^v_scale must be finite", id="nan"),
    pytest.param(dict(page_size=0), r"^page_size must be a positive integer", id="page-size-0"),
    pytest.param(dict(page_size=16.0), r"^page_size must be a positive integer", id="page-size-float"),
    pytest.param(dict(page_size=True), r"^page_size must be a positive integer", id="page-size-bool"),
    pytest.param(dict(context=0), r"^context must be a positive integer", id="context-0"),
    pytest.param(dict(context=60), r"^k must have shape .*64", id="context-needs-4-pages"),
]


@pytest.mark.parametrize("change,match", BAD_CACHES)
def test_bad_caches_name_the_argument(change, match):
    args = _cache_args()
    args.update(change)
    with pytest.raises(Fp8CacheError, match=match):
        Fp8KVCache(**args)
    with pytest.raises(Fp8CacheError, match=match):
        check_cache(*args.values())


@pytest.mark.parametrize(
    "x,page_size,match",
    [
        pytest.param(np.ones((4, 4)), 16, r"^x must have shape", id="x-2d"),
        pytest.param(np.full((1, 4, 4), np.inf), 16, r"^x must be finite", id="x-inf"),
        pytest.param(np.full((1, 4, 4), np.nan), 16, r"^x must be finite", id="x-nan"),
        pytest.param(np.ones((1, 4, 4)), 0, r"^page_size must be a positive integer", id="page-size-0"),
        pytest.param(
            np.ones((1, 4, 4)), -16, r"^page_size must be a positive integer", id="page-size-negative"
        ),
    ],
)
def test_quantize_kv_rejects_bad_inputs(x, page_size, match):
    with pytest.raises(Fp8CacheError, match=match):
        quantize_kv(x, page_size)
