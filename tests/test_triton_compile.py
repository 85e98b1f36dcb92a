"""The Triton kernels (fused nearest centroid / Lloyd step, the SVG2 planner's page streams and forward
work list items) compiled ahead of time for sm_90a's target (compute capability 9.0) without a GPU, as
``kernels.compile_check`` does for the CUDA sources: a kernel that does not compile for the H200 fails here, in CI."""

from __future__ import annotations

import pytest

triton = pytest.importorskip("triton")
pytest.importorskip("torch")

try:
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
except ImportError:  # pragma: no cover - an older Triton
    pytest.skip("this Triton has no ahead-of-time compile API", allow_module_level=True)

H200 = GPUTarget("cuda", 90, 32)


def _compile(fn, signature: dict, constexprs: dict, **options):
    sig = {**signature, **{name: "constexpr" for name in constexprs}}
    try:
        return triton.compile(
            ASTSource(fn=fn, signature=sig, constexprs=constexprs), target=H200, options=options or None
        )
    except RuntimeError as exc:  # no ptxas / CUDA backend in this install: nothing to check
        if "ptxas" in str(exc).lower() or "backend" in str(exc).lower():
            pytest.skip(f"Triton cannot compile for CUDA here: {exc}")
        raise


@pytest.mark.parametrize("dtype", ["bf16", "fp16"])
@pytest.mark.parametrize("accumulate", [False, True], ids=["assign", "lloyd_step"])
@pytest.mark.parametrize("head_dim", [64, 128])
def test_nearest_centroid_kernel_compiles_for_sm90(dtype, accumulate, head_dim):
    from sparseattn.nearest_centroid import BLOCK_K, BLOCK_T, _nearest_kernel

    sig = dict(
        x_ptr=f"*{dtype}",
        c_ptr=f"*{dtype}",
        csq_ptr="*fp32",
        out_ptr="*i64",
        sums_ptr="*fp32",
        counts_ptr="*fp32",
        tokens="i32",
        k="i32",
        stride_xn="i64",
        stride_xt="i32",
        stride_cn="i32",
        stride_ck="i32",
    )
    kernel = _compile(_nearest_kernel, sig, dict(D=head_dim, BT=BLOCK_T, BK=BLOCK_K, ACCUMULATE=accumulate))
    assert kernel.metadata.shared <= 227 * 1024


@pytest.mark.parametrize("grouped", [False, True], ids=["blocks", "groups"])
@pytest.mark.parametrize("split", [True, False], ids=["forward", "backward"])
@pytest.mark.parametrize("pages", [4, 8], ids=["B64", "B128"])
def test_page_stream_kernels_compile_for_sm90(split, pages, grouped):
    from sparseattn.planning.page_streams import BLOCK_J, _lengths_kernel, _write_kernel

    common = dict(sel_ptr="*u8", grp_ptr="*i32", full_ptr="*i32", part_ptr="*i32")
    sizes = dict(n_owner="i32", n_other="i32", n_groups="i32", s_r="i64", s_i="i64", s_j="i64")
    lengths_sig = {**common, "out_ptr": "*i64", **sizes}
    _compile(_lengths_kernel, lengths_sig, dict(GROUPED=grouped, BJ=BLOCK_J))
    sig = {
        **common,
        "rows_ptr": "*i32",
        "start_ptr": "*i64",
        "out_ptr": "*i32",
        **sizes,
        "capacity": "i64",
        "row_page_stride": "i64",
    }
    _compile(_write_kernel, sig, dict(P=pages, SPLIT=split, GROUPED=grouped, BJ=BLOCK_J))


@pytest.mark.parametrize("key", ["i32", "i64"])
@pytest.mark.parametrize("grouped", [False, True], ids=["blocks", "groups"])
@pytest.mark.parametrize("pages", [4, 8], ids=["B64", "B128"])
def test_forward_items_kernels_compile_for_sm90(pages, grouped, key):
    from sparseattn.planning.forward_items import (
        BLOCK_G,
        BLOCK_K,
        BLOCK_Q,
        _items_kernel,
        _live_groups_kernel,
    )

    sig = dict(
        q_rows_ptr="*i64",
        len_ptr="*i64",
        start_ptr="*i64",
        grp_ptr="*i64",
        own_ptr="*i32",
        info_ptr="*i32",
        key_ptr=f"*{key}",
        nq="i32",
        n_groups="i32",
    )
    consts = dict(P=pages, PAGE=16, OWN=8, CHUNK_PAGES=8, GROUPED=grouped, BQ=BLOCK_Q)
    assert _compile(_items_kernel, sig, consts).metadata.shared <= 227 * 1024
    sig = dict(
        mask_ptr="*u8",
        q_rows_ptr="*i64",
        grp_ptr="*i64",
        out_ptr="*u8",
        nq="i32",
        n_groups="i32",
        n_k="i32",
        s_r="i64",
        s_g="i64",
        s_k="i64",
    )
    kernel = _compile(_live_groups_kernel, sig, dict(BQ=BLOCK_Q, BG=BLOCK_G, BK=BLOCK_K))
    assert kernel.metadata.shared <= 227 * 1024


@pytest.mark.parametrize("sums", [False, True], ids=["copy", "copy_and_sums"])
@pytest.mark.parametrize("dtype", ["bf16", "fp32"])
@pytest.mark.parametrize("head_dim", [64, 96, 128])
def test_rows_to_slots_kernel_compiles_for_sm90(dtype, head_dim, sums):
    from sparseattn.slot_copy import BLOCK_ROWS, _rows_to_slots_kernel

    sig = dict(
        x_ptr=f"*{dtype}",
        src_ptr="*i32",
        out_ptr=f"*{dtype}",
        sum_idx_ptr="*i32",
        sums_ptr="*fp32",
        total="i64",
        stride_x="i64",
        stride_out="i64",
    )
    bd = 1 << (head_dim - 1).bit_length()
    kernel = _compile(_rows_to_slots_kernel, sig, dict(D=head_dim, BD=bd, BR=BLOCK_ROWS, SUMS=sums))
    assert kernel.metadata.shared <= 227 * 1024


@pytest.mark.parametrize("group_dtype", ["i32", "i64"])
def test_block_mask_kernel_compiles_for_sm90(group_dtype):
    from sparseattn.cluster_blocks import TILE_K, TILE_Q, _block_mask_kernel

    sig = dict(
        mask_ptr="*u8",
        qg_ptr=f"*{group_dtype}",
        kg_ptr=f"*{group_dtype}",
        out_ptr="*u8",
        q_blocks="i32",
        k_blocks="i32",
        q_clusters="i32",
        k_clusters="i32",
    )
    kernel = _compile(_block_mask_kernel, sig, dict(BQ=TILE_Q, BK=TILE_K))
    assert kernel.metadata.shared <= 227 * 1024


@pytest.mark.parametrize(
    "bisect, words", [(False, False), (True, False), (True, True)], ids=["sort", "bisect", "words"]
)
@pytest.mark.parametrize("block", [64, 1024, 4096])
def test_cluster_select_kernel_compiles_for_sm90(block, bisect, words):
    from sparseattn.cluster_select import _select_kernel

    sig = dict(
        dots_ptr="*fp64",
        bias_ptr="*fp64",
        params_ptr="*fp64",
        alive_ptr="*i64",
        least_ptr="*i64",
        out_ptr="*u8",
        q_clusters="i32",
        k_clusters="i32",
    )
    warps = 2 if block <= 1024 else 8  # select_mask's launch
    kernel = _compile(_select_kernel, sig, dict(BLOCK=block, BISECT=bisect, WORDS=words), num_warps=warps)
    assert kernel.metadata.shared <= 227 * 1024


@pytest.mark.parametrize("block", [16, 1024, 2048, 8192])
def test_vsa_select_kernel_compiles_for_sm90(block):
    from sparseattn.vsa_select import _row_topk_kernel

    sig = dict(scores_ptr="*fp32", live_ptr="*u8", out_ptr="*i32", cols="i32", kept="i32")
    kernel = _compile(_row_topk_kernel, sig, dict(BLOCK=block))
    assert kernel.metadata.shared <= 227 * 1024


@pytest.mark.parametrize("d", [64, 128])
def test_zero_rows_kernel_compiles_for_sm90(d):
    from sparseattn.slot_copy import BLOCK_ROWS, _zero_rows_kernel

    sig = dict(y_ptr="*bf16", rows_ptr="*i64", n_rows="i32", slots="i32")
    kernel = _compile(_zero_rows_kernel, sig, dict(D=d, BR=BLOCK_ROWS))
    assert kernel.metadata.shared <= 227 * 1024


@pytest.mark.parametrize("update", [False, True], ids=["operands", "update"])
@pytest.mark.parametrize("d", [64, 128])
def test_centroid_update_kernel_compiles_for_sm90(update, d):
    from sparseattn.centroid_update import ROWS, _operands_kernel

    sig = dict(
        prev_ptr="*fp32",
        sums_ptr="*fp32",
        sizes_ptr="*fp32",
        cent_ptr="*fp32",
        low_ptr="*u16",
        csq_ptr="*fp32",
        rows="i32",
    )
    kernel = _compile(_operands_kernel, sig, dict(D=d, ROWS_PER_PROGRAM=ROWS, UPDATE=update))
    assert kernel.metadata.shared <= 227 * 1024


@pytest.mark.parametrize("block", [64, 128])
def test_layout_blocks_kernels_compile_for_sm90(block):
    from sparseattn.layout_blocks import BLOCKS, _block_arrays_kernel, _group_starts_kernel

    sig = dict(sizes_ptr="*i64", start_ptr="*i64", end_ptr="*i32", slots_ptr="*i64", groups="i32")
    kernel = _compile(_group_starts_kernel, sig, dict(B=block, BLOCK_G=1024), num_warps=4)
    assert kernel.metadata.shared <= 227 * 1024
    sig = dict(
        sizes_ptr="*i64",
        end_ptr="*i32",
        group_ptr="*i64",
        rows_ptr="*i64",
        pages_ptr="*i64",
        valid_ptr="*u8",
        groups="i32",
        max_blocks="i32",
    )
    kernel = _compile(_block_arrays_kernel, sig, dict(B=block, BR=block, PAGE=16, BB=BLOCKS, STEPS=10))
    assert kernel.metadata.shared <= 227 * 1024


@pytest.mark.parametrize("d", [64, 128])
def test_selection_means_kernel_compiles_for_sm90(d):
    from sparseattn.centroid_update import ROWS, _means_kernel

    sig = dict(
        sums_ptr="*fp32", sizes_ptr="*i64", prev_ptr="*fp32", cent_ptr="*fp32", means_ptr="*fp64", rows="i32"
    )
    kernel = _compile(_means_kernel, sig, dict(D=d, ROWS_PER_PROGRAM=ROWS))
    assert kernel.metadata.shared <= 227 * 1024
