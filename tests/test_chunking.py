"""neuronmp.chunking: the one chunk plan (split, plan, pad, join, strip)."""
import pytest
import torch

from neuronmp import chunking


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
