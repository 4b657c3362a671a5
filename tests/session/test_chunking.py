"""neuronmp.session.chunking: the one chunk plan (split, plan, pad, join, strip)."""
import pytest
import torch

from neuronmp.session import chunking


@pytest.mark.parametrize("size, n, sizes, uneven", [
    (8, 4, [2, 2, 2, 2], False),
    (5, 2, [3, 2], True),            # the remainder goes to the first chunks, one row each
    (7, 4, [2, 2, 2, 1], True),
    (3, 4, [1, 1, 1], False),        # fewer rows than cores: one row per core
    (0, 4, [0], False),
])
def test_split_sizes_follow_the_sdk_rule(size, n, sizes, uneven):
    assert chunking.split_sizes(size, n) == (sizes, uneven)
    assert sum(chunking.split_sizes(size, n)[0]) == size


@pytest.mark.parametrize("rows, batch, targets, padding, counts", [
    (8, 4, 2, 0, [1, 1]),
    (9, 4, 2, 3, [2, 1]),     # three traced batches, the last padded, 2 + 1 over two cores
    (1, 4, 4, 3, [1]),        # one padded batch uses one core
    (64, 1, 4, 0, [16, 16, 16, 16]),
    (64, 1, 1, 0, [64]),      # one core: one message with every traced batch
])
def test_plan_spreads_whole_traced_batches_over_the_cores(rows, batch, targets, padding,
                                                          counts):
    assert chunking.plan(rows, batch, targets) == (padding, counts)


def test_pad_join_strip_round_trip():
    x = torch.arange(10.0).reshape(5, 2)
    padded = chunking.pad([x], 3)[0]
    assert padded.shape == (8, 2) and torch.equal(padded[5:], torch.zeros(3, 2))
    assert chunking.pad([x], 0)[0] is x
    parts = [[padded[:4]], [padded[4:]]]
    assert torch.equal(chunking.strip(chunking.join(parts), 5)[0], x)
    assert chunking.join([[x]])[0] is x


@pytest.mark.parametrize("rows, targets, pieces", [
    (1, 1, [(1, 1)]),
    (3, 1, [(3, 4)]),
    (32, 1, [(32, 32)]),
    (33, 1, [(32, 32), (1, 1)]),        # past the largest: split, the rest in its own bucket
    (70, 1, [(32, 32), (32, 32), (6, 8)]),
    (32, 4, [(8, 8)] * 4),               # more cores than 32-row pieces: spread evenly
    (6, 4, [(2, 4), (2, 4), (1, 1), (1, 1)]),
    (3, 4, [(1, 1)] * 3),                # fewer rows than cores: one row per core
    (65, 2, [(32, 32), (32, 32), (1, 1)]),
])
def test_bucket_pieces_fill_the_largest_bucket_or_spread_over_cores(rows, targets, pieces):
    buckets = (1, 4, 8, 16, 32)
    assert chunking.bucket_pieces(rows, buckets, targets) == pieces
    assert sum(n for n, _ in pieces) == rows


def test_fit_is_the_smallest_bucket_holding_the_rows():
    buckets = (2, 4, 8)
    assert [chunking.fit(r, buckets) for r in range(1, 10)] == [2, 2, 4, 4, 8, 8, 8, 8, 8]
    assert chunking.check_buckets([2, 4, 8], 4) == (2, 4, 8)


# -- the row cutter (neuronmp.session._rowcut): DataParallel's chunks as row ranges -----------


def _spec(t):
    code, shape = chunking.row_specs([(tuple(t.shape), t.dtype)], t.shape[0])[0]
    return code, shape


def _cut(t, sizes, code, shape):
    got = chunking.row_ranges([t], sizes, [(code, shape)])
    return None if got is None else got[0]


def test_row_ranges_are_rows_of_the_input_in_order():
    x = torch.arange(40.0).reshape(8, 5)
    parts = _cut(x, [3, 0, 5], *_spec(x))
    assert [p.tensor().shape[0] for p in parts] == [3, 0, 5]
    assert all(p[1] is x for p in parts)                  # no view made per chunk
    assert torch.equal(torch.cat([p.tensor() for p in parts]), x)
    assert chunking.row_ranges([x, x], [8], [_spec(x)]) is None   # one spec per input


def test_row_ranges_are_made_only_of_tensors_that_fit_the_spec_exactly():
    x = torch.rand(8, 4)
    code, shape = _spec(x)
    assert _cut(x, [4, 4], code, shape) is not None
    refused = [
        (x.t().contiguous().t(), [4, 4], code, shape),   # not contiguous
        (x, [4, 3], code, shape),                         # sizes do not add up to dim 0
        (x, [4, -1, 5], code, shape),                     # a negative size
        (x, [4, 4], chunking.row_specs([((1,), torch.float64)], 1)[0][0], shape),   # another dtype
        (x, [4, 4], code, (8, 5)),                        # another trailing shape
        (x, [4, 4], code, (8, 4, 1)),                     # another rank
        (torch.tensor(1.0), [1], code, ()),               # no dim 0
        (x.numpy(), [4, 4], code, shape),                 # not a tensor
        (x, (4, 4), code, shape),                         # sizes not a list
    ]
    for args in refused:
        assert _cut(*args) is None, args
