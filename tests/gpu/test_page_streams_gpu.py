"""The CUDA page-stream writers (``page_streams.WRITER = "cuda"``, ``kernels_cu/page_streams.cu``) against the
Triton writers: the same lengths and the same bytes (every entry of a poison-filled buffer, written or not)
on random cases, and SVG2's planners by clusters and by blocks equal field by field on random partitions."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

pytestmark = pytest.mark.gpu

POISON = -7


def writer_case(seed: int, grouped: bool, split: bool, pages: int, device):
    """``(sel, full, part, rows, other_group, pages, row_page_stride, cut)`` of case ``seed``: 1–3 rows, 1–24
    items a row, 1 to 300 blocks of the other side (multiples of 32 and not); a row of empty blocks, an item
    selecting nothing, blocks of a partial page alone; group ids -2 to ``groups + 1`` (outside the range
    selects nothing); ``sel`` contiguous, transposed, or a strided slice with a storage offset; ``cut``:
    whether the capacity is to sit below the total."""
    g = torch.Generator().manual_seed(seed)
    ri = lambda lo, hi, shape=(): torch.randint(lo, hi, shape, generator=g)
    r, n_owner = 1 + seed % 3, 1 + int(ri(0, 24))
    n_other = (1, 31, 32, 33, 64, 95, 300)[seed % 7]
    n_cols = 1 + int(ri(0, 20)) if grouped else n_other
    density = (0.05, 0.3, 0.7)[seed % 3]
    layout = seed % 4
    if layout == 1:  # transposed, as the backward passes its selection
        sel = (torch.rand(r, n_cols, n_owner, generator=g) < density).to(device).transpose(1, 2)
    elif layout == 3:  # a strided slice with a storage offset
        big = torch.rand(r + 1, n_owner + 1, 2 * n_cols + 1, generator=g) < density
        sel = big.to(device)[1:, 1:, 1::2]
    else:
        sel = (torch.rand(r, n_owner, n_cols, generator=g) < density).to(device)
    sel[:, 0] = False  # the first item of each row selects nothing
    full = ri(0, pages + 1, (r, n_other))
    part = ri(0, 2, (r, n_other))
    full[:, ::5], part[:, ::5] = 0, 1  # blocks of a partial page alone
    if r > 1:
        full[1], part[1] = 0, 0  # a row of empty blocks
    rows = full * 16 + part * ri(1, 16, (r, n_other))
    group = ri(-2, n_cols + 2, (r, n_other)).to(torch.int32).to(device) if grouped else None
    stride = (0, n_other * pages + 3)[seed % 2]
    ints = (x.to(torch.int32).contiguous().to(device) for x in (full, part, rows))
    return (sel, *ints, group, pages, stride, (seed // 2) % 2 == 0)


def _writers_called(monkeypatch):
    """Counts of the CUDA launchers' calls (the dispatch must reach them)."""
    from sparseattn.kernels import page_streams as cuda_streams

    calls = {"stream_lengths": 0, "write_streams": 0}
    for name in calls:
        fn = getattr(cuda_streams, name)

        def counted(*args, _fn=fn, _name=name, **kwargs):
            calls[_name] += 1
            return _fn(*args, **kwargs)

        monkeypatch.setattr(cuda_streams, name, counted)
    return calls


@pytest.mark.parametrize("pages", [4, 8], ids=lambda p: f"P{p}")
@pytest.mark.parametrize("split", [False, True], ids=["backward", "forward"])
@pytest.mark.parametrize("grouped", [False, True], ids=["blocks", "groups"])
def test_cuda_writer_writes_the_triton_writers_bytes(grouped, split, pages, monkeypatch):
    """28 random cases per form: lengths equal, and ``out`` (poison-filled) equal in every entry, including
    the unwritten ones; the capacity below the total in half of them."""
    from sparseattn.kernels import page_streams as cuda_streams
    from sparseattn.planning import page_streams

    calls = _writers_called(monkeypatch)
    for seed in range(28):
        sel, full, part, rows, group, p, stride, cut = writer_case(seed, grouped, split, pages, "cuda")
        assert cuda_streams.available(sel)
        got = {}
        for writer in ("triton", "cuda"):
            monkeypatch.setattr(page_streams, "WRITER", writer)
            lengths = page_streams.stream_lengths(sel, full, part, group)
            got[writer] = [lengths]
        assert torch.equal(got["cuda"][0], got["triton"][0]), seed
        lengths = got["triton"][0]
        start = lengths.cumsum(0) - lengths
        total = int(lengths.sum())
        capacity = total // 2 if cut else total + 5
        shape = (capacity + 3, 2) if split else (capacity + 3,)
        for writer in ("triton", "cuda"):
            monkeypatch.setattr(page_streams, "WRITER", writer)
            out = torch.full(shape, POISON, dtype=torch.int32, device="cuda")
            page_streams.write_streams(
                sel, full, part, rows if split else None, start, out, capacity, p, stride, split, group
            )
            got[writer].append(out)
        torch.cuda.synchronize()
        assert torch.equal(got["cuda"][1], got["triton"][1]), (seed, sel.shape, sel.stride())
        written = min(total, capacity)
        assert not (got["cuda"][1][written:] != POISON).any(), seed  # nothing past the stream or capacity
    assert calls == {"stream_lengths": 28, "write_streams": 28}


@pytest.mark.parametrize("pages", [4, 8], ids=lambda p: f"P{p}")
@pytest.mark.parametrize("grouped", [False, True], ids=["blocks", "groups"])
def test_one_walk_writer_writes_the_two_walk_writers_bytes(grouped, pages):
    """``page_stream_write_one_walk`` (the forward's split streams in one walk, ``WRITER = "cuda_one_walk"``)
    against the two-walk CUDA writer on the 28 random cases: the lengths equal, the partial counts equal
    ``Σ sel · part``, and ``out`` (poison-filled) equal in every entry; the capacity below the total in half."""
    from sparseattn.kernels import page_streams as cuda_streams

    for seed in range(28):
        sel, full, part, rows, group, p, stride, cut = writer_case(seed, grouped, True, pages, "cuda")
        lengths = cuda_streams.stream_lengths(sel, full, part, group)
        got_lengths, partials = cuda_streams.stream_lengths(sel, full, part, group, with_partials=True)
        assert torch.equal(got_lengths, lengths), seed
        chosen = (
            sel
            if group is None
            else torch.gather(
                sel, 2, group.long().clamp(0, sel.shape[2] - 1).unsqueeze(1).expand(-1, sel.shape[1], -1)
            )
            & ((group >= 0) & (group < sel.shape[2])).unsqueeze(1)
        )
        want_partials = (chosen.long() * part.long().unsqueeze(1)).sum(-1).reshape(-1)
        assert torch.equal(partials, want_partials), seed
        start = lengths.cumsum(0) - lengths
        total = int(lengths.sum())
        capacity = total // 2 if cut else total + 5
        outs = []
        for one_walk in (None, (lengths, partials)):
            out = torch.full((capacity + 3, 2), POISON, dtype=torch.int32, device="cuda")
            cuda_streams.write_streams(
                sel, full, part, rows, start, out, capacity, p, stride, True, group, one_walk=one_walk
            )
            outs.append(out)
        torch.cuda.synchronize()
        assert torch.equal(outs[1], outs[0]), (seed, sel.shape, sel.stride())


def test_cuda_writer_refuses_bad_arguments_before_any_launch():
    """The launcher's checks name the argument."""
    from sparseattn.kernels import page_streams as cuda_streams

    sel, full, part, rows, _, p, stride, _ = writer_case(0, False, True, 4, "cuda")
    start = torch.zeros(sel.shape[0] * sel.shape[1], dtype=torch.int64, device="cuda")
    out = torch.full((10, 2), POISON, dtype=torch.int32, device="cuda")
    with pytest.raises(ValueError, match="full must be an int32"):
        cuda_streams.stream_lengths(sel, full.long(), part)
    with pytest.raises(ValueError, match="out must be an int32"):
        cuda_streams.write_streams(sel, full, part, rows, start, out, 11, p, stride, True)
    with pytest.raises(ValueError, match="start must be an int64"):
        cuda_streams.write_streams(sel, full, part, rows, start[1:], out, 10, p, stride, True)
    with pytest.raises(ValueError, match="8-byte aligned"):
        cuda_streams.write_streams(
            sel, full, part, rows, start, out.view(-1)[1:-1].view(-1, 2), 4, p, stride, True
        )
    with pytest.raises(ValueError, match="one_walk's partials must be an int64"):
        cuda_streams.write_streams(
            sel, full, part, rows, start, out, 10, p, stride, True, one_walk=(start, start[1:])
        )
    torch.cuda.synchronize()
    assert (out == POISON).all()


def _plans_equal(a, b) -> str | None:
    """The first field where two plans (``DynamicWorkList`` / ``DynamicOwnedPlan``) differ, or None; the
    stream buffers over their written entries (the rest is uninitialised)."""
    import dataclasses

    used = min(int(b.status[0]), b.capacity)
    for field in dataclasses.fields(b):
        x, y = getattr(a, field.name), getattr(b, field.name)
        if field.name in ("stream_entries", "stream_pages"):
            x, y = x[:used], y[:used]
        if not (torch.equal(x, y) if isinstance(y, torch.Tensor) else x == y):
            return field.name
    return None


def test_planners_with_the_cuda_writer_equal_the_triton_writers_on_20_partitions(monkeypatch):
    """SVG2's planners by clusters (forward work list, backward plan) and by blocks with ``WRITER = "cuda"``
    against ``"triton"``, field by field, on 20 random per-row partitions and cluster selections (every
    tenth with a capacity that cuts the streams)."""
    from test_dynamic_layouts_gpu import _random_partitions

    from sparseattn.planning import dynamic_layouts as dl
    from sparseattn.planning import page_streams
    from sparseattn.svg2_device import cluster_block_mask

    calls = _writers_called(monkeypatch)
    g = torch.Generator(device="cuda").manual_seed(2)
    for case in range(20):
        rows, block, ql, kl = _random_partitions(case, g)
        pairs = torch.rand(rows, 13, 21, device="cuda", generator=g) < 0.05 + case / 25
        blocks = cluster_block_mask(pairs, ql.block_group, kl.block_group)
        capacity = 50 if case % 10 == 9 else None
        groups = (ql.block_rows, kl.block_rows, ql.block_group, kl.block_group, pairs, block)
        by_blocks = (ql.block_rows, kl.block_rows, blocks, block)
        plans = {
            "fwd_clusters": (dl.cluster_forward_work_list, groups),
            "bwd_clusters": (dl.cluster_backward_plan, groups),
            "fwd_blocks": (dl.forward_work_list, by_blocks),
            "bwd_blocks": (dl.backward_plan, by_blocks),
        }
        for name, (plan, args) in plans.items():
            got = {}
            for writer in ("triton", "cuda", "cuda_one_walk"):
                monkeypatch.setattr(page_streams, "WRITER", writer)
                got[writer] = plan(*args, capacity=capacity)
            for writer in ("cuda", "cuda_one_walk"):
                differs = _plans_equal(got[writer], got["triton"])
                assert differs is None, (case, name, writer, differs)
    assert calls["write_streams"] == calls["stream_lengths"] == 20 * 4 * 2
