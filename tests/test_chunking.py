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
