"""neuronmp.session.pytree: output specs and torch.nn.DataParallel's scatter/gather rules."""
import collections

import pytest
import torch

from neuronmp.session import pytree


def test_spec_flatten_unflatten_round_trip_keeps_the_structure():
    a, b, c = torch.zeros(1), torch.ones(2), torch.full((3,), 2.0)
    out = {"x": (a, [b, c]), "y": a}
    spec = pytree.spec_of(out)
    assert spec == ["dict", [["x", ["tuple", [0, ["list", [1, 2]]]]], ["y", 3]]]
    flat = pytree.flatten(out, spec)
    assert [t is s for t, s in zip(flat, (a, b, c, a))] == [True] * 4
    again = pytree.unflatten(flat, spec)
    assert isinstance(again["x"], tuple) and isinstance(again["x"][1], list)
    assert pytree.leaves(spec) == 4


@pytest.mark.parametrize("bad", [None, (), {}, {1: torch.zeros(1)}, 3.0])
def test_outputs_that_are_not_tensor_trees_are_refused_naming_the_type(bad):
    with pytest.raises(TypeError, match="outputs must be tensors"):
        pytree.spec_of(bad)


def test_scatter_and_gather_follow_torch_nn_dataparallel():
    Pair = collections.namedtuple("Pair", "left right")
    x = torch.arange(6.0).reshape(6, 1)
    parts = pytree.scatter({"t": x, "n": 7, "p": Pair(x, [x])}, [4, 2], 0)
    assert [p["t"].shape[0] for p in parts] == [4, 2] and parts[1]["n"] == 7
    assert isinstance(parts[0]["p"], Pair) and parts[0]["p"].right[0].shape == (4, 1)
    whole = pytree.gather([{"t": p["t"], "s": torch.tensor(1.0)} for p in parts], 0)
    assert torch.equal(whole["t"], x) and whole["s"].shape == (2,)   # scalars are stacked
    assert pytree.first_tensor([1, {"a": x}]) is x
