"""assign_buckets / aligned_offsets / make_flat_block of decentpy._C."""
import pytest
import torch

from decentpy import _C


def py_assign(sizes, keys, cap):
    """Straightforward model of the documented rule."""
    if cap <= 0:
        return [[i] for i in range(len(sizes))]
    out, open_ = [], {}
    for i, (s, k) in enumerate(zip(sizes, keys)):
        b = open_.setdefault(k, [[], 0])
        b[0].append(i)
        b[1] += s
        if b[1] >= cap:
            out.append(b[0])
            del open_[k]
    out += sorted((b[0] for b in open_.values()), key=lambda m: m[0])
    return out


def test_assign_simple():
    assert _C.assign_buckets([10, 10, 10, 10], [0, 0, 0, 0], 20) == [[0, 1], [2, 3]]
    assert _C.assign_buckets([10, 10, 5], [0, 0, 0], 25) == [[0, 1, 2]]
    assert _C.assign_buckets([30, 1, 1], [0, 0, 0], 20) == [[0], [1, 2]]


def test_assign_split_by_key_and_closing_order():
    sizes = [8, 4, 8, 4, 4, 1]
    keys = [0, 1, 0, 1, 1, 2]
    # cap 12: key 0 closes at tensor 2 (16 bytes), key 1 at tensor 4 (12 bytes), key 2 stays open.
    got = _C.assign_buckets(sizes, keys, 12)
    assert got == [[0, 2], [1, 3, 4], [5]]
    # Still-open buckets are closed in the order of their first tensor.
    assert _C.assign_buckets([1, 1, 1], [2, 1, 0], 100) == [[0], [1], [2]]


def test_assign_cap_nonpositive():
    assert _C.assign_buckets([1, 2, 3], [0, 1, 0], 0) == [[0], [1], [2]]
    assert _C.assign_buckets([1, 2, 3], [0, 1, 0], -5) == [[0], [1], [2]]
    assert _C.assign_buckets([], [], 10) == []


def test_assign_random_against_model():
    g = torch.Generator().manual_seed(0)
    for _ in range(50):
        n = int(torch.randint(0, 40, (1,), generator=g))
        sizes = torch.randint(0, 100, (n,), generator=g).tolist()
        keys = torch.randint(0, 3, (n,), generator=g).tolist()
        cap = int(torch.randint(-1, 300, (1,), generator=g))
        got = _C.assign_buckets(sizes, keys, cap)
        assert got == py_assign(sizes, keys, cap)
        assert sorted(i for b in got for i in b) == list(range(n))


def test_assign_mismatched_lengths():
    with pytest.raises(ValueError, match="size_bytes has 2 entries but keys has 1"):
        _C.assign_buckets([1, 2], [0], 10)


def test_aligned_offsets():
    offs, total = _C.aligned_offsets([3, 5, 32, 1], 4, 128)
    assert offs == [0, 32, 64, 96]
    assert total == 128
    offs, total = _C.aligned_offsets([3, 5], 2, 128)  # 64 elements of 2 bytes
    assert offs == [0, 64] and total == 128
    offs, total = _C.aligned_offsets([], 4, 128)
    assert offs == [] and total == 0
    offs, total = _C.aligned_offsets([0, 7, 0], 4, 16)
    assert offs == [0, 0, 8] and total == 8
    offs, total = _C.aligned_offsets([3, 3], 4, 0)  # no alignment
    assert offs == [0, 3] and total == 6
    for o in _C.aligned_offsets(list(range(1, 50)), 4, 128)[0]:
        assert o % 32 == 0


def test_make_flat_block_values_and_sharing():
    ts = [torch.randn(3, 4), torch.randn(7), torch.randn(2, 2, 2)]
    offs, total = _C.aligned_offsets([t.numel() for t in ts], 4, 128)
    block, views = _C.make_flat_block(ts, offs, total, True)
    assert block.dim() == 1 and block.numel() == total and block.dtype == torch.float32
    for t, v, o in zip(ts, views, offs):
        assert v.shape == t.shape
        assert torch.equal(v, t)
        assert v.untyped_storage().data_ptr() == block.untyped_storage().data_ptr()
        assert v.storage_offset() == o
    # Padding is zero.
    assert float(block[12:32].abs().sum()) == 0.0
    # Writes through a view land in the block.
    views[1].fill_(5.0)
    assert torch.equal(block[offs[1]:offs[1] + 7], torch.full((7,), 5.0))


def test_make_flat_block_no_copy_is_zero():
    ts = [torch.randn(5), torch.randn(6)]
    block, views = _C.make_flat_block(ts, [0, 8], 16, False)
    assert float(block.abs().sum()) == 0.0
    assert all(float(v.abs().sum()) == 0.0 for v in views)


def test_make_flat_block_channels_last():
    w = torch.randn(8, 3, 5, 5).to(memory_format=torch.channels_last)
    b = torch.randn(8)
    block, (vw, vb) = _C.make_flat_block([w, b], [0, 600], 608, True)
    assert vw.is_contiguous(memory_format=torch.channels_last)
    assert not vw.is_contiguous()
    assert vw.stride() == w.stride()
    assert torch.equal(vw, w)
    assert torch.equal(vb, b)
    # The channels_last view covers block[0:600] densely, in memory order.
    assert torch.equal(block[:600], w.permute(0, 2, 3, 1).reshape(-1))


def test_make_flat_block_non_dense_source_gets_contiguous_view():
    base = torch.randn(4, 6)
    t = base[:, ::2]  # not dense
    block, (v,) = _C.make_flat_block([t], [0], 12, True)
    assert v.is_contiguous()
    assert torch.equal(v, t)


def test_make_flat_block_keeps_requires_grad_out():
    p = torch.nn.Parameter(torch.randn(10))
    block, (v,) = _C.make_flat_block([p], [0], 16, True)
    assert not block.requires_grad and not v.requires_grad
    assert torch.equal(v, p.detach())


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float64])
def test_make_flat_block_dtypes(dtype):
    ts = [torch.randn(3).to(dtype), torch.randn(4).to(dtype)]
    block, views = _C.make_flat_block(ts, [0, 64], 128, True)
    assert block.dtype == dtype
    assert all(torch.equal(v, t) for v, t in zip(views, ts))


def test_make_flat_block_errors():
    with pytest.raises(RuntimeError, match=r"tensors\[1\] has dtype Half but tensors\[0\] has dtype Float"):
        _C.make_flat_block([torch.zeros(2), torch.zeros(2, dtype=torch.half)], [0, 2], 4, True)
    with pytest.raises(RuntimeError, match=r"tensors\[1\].*does not fit"):
        _C.make_flat_block([torch.zeros(2), torch.zeros(3)], [0, 2], 4, True)
    with pytest.raises(RuntimeError, match=r"overlaps"):
        _C.make_flat_block([torch.zeros(2), torch.zeros(3)], [0, 1], 8, True)
    with pytest.raises(RuntimeError, match=r"3 offsets"):
        _C.make_flat_block([torch.zeros(2)], [0, 1, 2], 8, True)
