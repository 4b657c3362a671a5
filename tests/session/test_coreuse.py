"""neuronmp.session.coreuse: the per-runtime core-usage book and the SDK's placement rules."""
import pytest

from neuronmp.session.coreuse import MULTICORE, Book, validate


def test_default_placement_is_the_least_used_core_round_robin():
    book = Book(4)
    assert [book.choose() for _ in range(5)] == [(0,), (1,), (2,), (3,), (0,)]
    assert book.usage() == (2, 1, 1, 1)
    book.release((2,))
    assert book.choose() == (2,)          # the least used, scanning after the last pick


def test_blocks_wrap_and_multicore_takes_every_core():
    book = Book(4)
    assert book.choose(2, 1) == (2,)
    assert book.choose(-1, 2) == (3, 0)   # the least used after the last pick, wrapping
    assert book.choose(-1, MULTICORE) == (0, 1, 2, 3)
    assert book.usage() == (2, 1, 2, 2)
    assert book.take((1, 2)) == (1, 2) and book.usage() == (2, 2, 3, 2)
    with pytest.raises(ValueError, match=r"placement \[4\] does not fit the 4 visible"):
        book.take((4,))


@pytest.mark.parametrize("start, count, message", [
    (-1, 0, "nc_count=0. Cannot be set to 0"),
    (-1, -2, "nc_count=-2"),
    (-1, 5, r"nc_count=5.*visible NeuronCores \(4\)"),
    (4, 1, "start_nc=4"),
    (3, 2, "nc:3-nc:4"),
])
def test_bad_placements_are_refused_with_the_sdks_wording(start, count, message):
    with pytest.raises(ValueError, match=message):
        validate(start, count, 4)
    with pytest.raises(TypeError, match="nc_count must be an int"):
        validate(0, "2", 4)
