"""ipc.codec: frames of tensors and pytrees, through a real ring, by copy and by view.

The examples name the layouts the codec picks; the hypothesis suite then
round-trips arbitrary dtypes, shapes, strides and pytrees, at sizes around
the ring's inline limit and the arena limit.
"""
import pickle
import weakref

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from neuronmp.ipc import codec
from neuronmp.ipc import ring as ring_mod
from neuronmp.ipc.ring import Ring
from neuronmp.session import chunking

_DTYPES = list(codec.DTYPES.values())


def _random(dtype, shape):
    n = torch.Size(shape).numel() * dtype.itemsize
    raw = torch.randint(0, 256, (max(1, n),), dtype=torch.uint8)
    if dtype == torch.bool:
        return (raw[:n] & 1).bool().reshape(shape)
    return raw[:n].view(dtype).reshape(shape) if n else torch.empty(shape, dtype=dtype)



def _round_trip(owner, peer, obj, same):
    owner.send(obj)
    same(obj, peer.recv(timeout=5))
    owner.send(obj)
    with peer.recv_view(timeout=5) as frame:
        same(obj, frame.value)


@pytest.mark.parametrize("dtype", _DTYPES, ids=str)
def test_every_dtype_round_trips_by_copy_and_view(pair, same, dtype):
    for shape in [(), (0,), (5,), (3, 0, 2), (2, 3), (1, 2, 1, 3, 2, 1)]:
        _round_trip(*pair, _random(dtype, shape), same)


def test_shapes_layouts_and_pytrees(pair, same):
    owner, peer = pair
    base = torch.arange(60, dtype=torch.float64).reshape(3, 4, 5)
    cases = [
        base.transpose(0, 2),                      # non-contiguous
        base[:, 1],                                # a strided view
        torch.randn(2, 3, dtype=torch.complex64).conj(),   # conj bit
        torch.randn(2, 3, dtype=torch.complex64).conj().imag,  # neg bit
        torch.zeros(1, 1, 1, 1, 1, 2, 1),          # >4-d
        torch.tensor(3.5),                         # 0-d
        (base, base[0]),
        [base, torch.ones(0)],
        {"x": base, "y": (torch.tensor([True, False]), [torch.tensor(1j)])},
        ("run", 7, None, 2.5, b"raw", (base,)),
        (),
        [],
        {"empty": {}},
        12345,
        None,
    ]
    for obj in cases:
        owner.send(obj)
        same(obj, peer.recv(timeout=5))
    peer.send((base, {"k": 1}))  # the other direction of the same ring
    same((base, {"k": 1}), owner.recv(timeout=5))


@pytest.mark.parametrize("dtype", _DTYPES, ids=str)
def test_every_dtype_round_trips_inside_packed_frames(pair, same, dtype, next_kind):
    # the pool's request and answer shapes travel on the C fast path (PACKED)
    owner, peer = pair
    xs = tuple(_random(dtype, s) for s in [(), (0,), (7,), (2, 0), (3, 1, 2), (1,) * 16])
    for obj in [(1, 2 ** 62, -3, xs), (2 ** 62, True, xs[2]), [False, None, list(xs)]]:
        owner.send(obj)
        assert next_kind(peer) == codec.PACKED
        same(obj, peer.recv(timeout=5))
        owner.send(obj)
        with peer.recv_view(timeout=5) as frame:
            same(obj, frame.value)


class _Op(int):
    pass


def _nest(depth):
    obj = 1
    for _ in range(depth):
        obj = (obj,)
    return obj


def test_packed_leaves_keep_types_and_the_rest_falls_back_to_pickle(pair, same, next_kind):
    owner, peer = pair
    t = torch.arange(6.0).reshape(2, 3)
    packed = [
        (1, -1, 0, 2 ** 63 - 1, -(2 ** 63), 2.5, float("inf"), True, False, None),
        ("str", "ünïcode", "", b"raw\x00", b"", (t, [t, (t,)]), [], ()),
        (7, False, ("ValueError", "bad value", "Traceback..." * 50)),
        _nest(16),
    ]
    pickled = [
        (2 ** 63, t),                  # int beyond int64
        (_Op(3), t),                   # int subclass keeps its type
        ("x" * 5000, t),               # skeleton too long
        (t.t(), 1),                    # non-contiguous tensor: prepared
        (torch.zeros((1,) * 17), 1),   # more dims than the fast path takes
        tuple(torch.ones(1) for _ in range(33)) + (1,),  # more tensors than it takes
        _nest(17),                     # too deep
        ("\ud800", 1),                 # lone surrogate: not UTF-8
        {"k": t},
    ]
    for obj, kind in [(o, codec.PACKED) for o in packed] + [(o, codec.PICKLED) for o in pickled]:
        owner.send(obj)
        assert next_kind(peer) == kind, obj
        got = peer.recv(timeout=5)
        same(obj, got)
        assert [type(x) for x in obj] == [type(x) for x in got]


def test_a_tensor_subclass_arrives_as_a_tensor(pair, next_kind):
    owner, peer = pair
    t = torch.arange(6.0)
    owner.send((torch.nn.Parameter(t), 1))
    assert next_kind(peer) == codec.PICKLED
    got, one = peer.recv(timeout=5)
    assert type(got) is torch.Tensor and torch.equal(got, t) and one == 1


@pytest.mark.parametrize("msg", [
    (3, True, [torch.ones(2), torch.zeros(2), torch.full((2,), 5.0)]),   # 3 items, 3 tensors
    [torch.ones(1), (torch.zeros(1),)],                                  # 2 items, 2 tensors
    (torch.ones(1), 7),
])
def test_structure_survives_when_tensor_count_equals_item_count(pair, same, msg):
    owner, peer = pair
    owner.send(msg)
    same(msg, peer.recv(timeout=5))


def test_unsendable_values_are_refused_clearly_and_the_ring_stays_usable(pair):
    owner, peer = pair
    with pytest.warns(UserWarning):  # torch deprecates quantized tensors
        q = torch.quantize_per_tensor(torch.ones(2), 0.1, 0, torch.qint8)
    with pytest.raises(TypeError, match="dtype torch.qint8 on a ring: expected one of"):
        owner.send(q)
    with pytest.raises(TypeError, match="sparse_coo tensor on a ring: expected a dense"):
        owner.send(torch.eye(2).to_sparse())
    with pytest.raises(TypeError, match="Cannot send dict on a ring"):
        owner.send({"f": lambda: 1})
    owner.send(torch.ones(2))
    assert torch.equal(peer.recv(timeout=1), torch.ones(2))


def test_a_record_of_unknown_kind_is_corrupt(pair):
    owner, peer = pair
    owner.send({"k": 1})  # a PICKLED record, decoded by codec.read
    base = 4096 + peer._read % peer.capacity
    codec.REC.pack_into(peer._buf, base, *codec.REC.unpack_from(peer._buf, base)[:1], 99, 0, 0)
    with pytest.raises(ValueError, match="corrupt ring record: kind 99"):
        peer.recv(timeout=1)


def test_a_spill_record_names_its_segment_and_pickled_skeletons_stay_pickles():
    plan = codec.spill_plan("nmp-1-2-0123456789abcdef", codec.ARENA)
    buf = bytearray(plan.length)
    codec.write(buf, 0, plan)
    assert codec.read(buf, 0, True) == (codec.ARENA, "nmp-1-2-0123456789abcdef")
    plan = codec.plan({"a": [1, 2]})
    buf = bytearray(plan.length)
    codec.write(buf, 0, plan)
    assert codec.read(buf, 0, True) == (codec.PICKLED, {"a": [1, 2]})
    assert pickle.loads(plan.skel) == {"a": [1, 2]}


# -- properties -------------------------------------------------------------------

def _laid_out(draw, dtype, shape):
    """A tensor of ``shape``: contiguous, or a view with other strides, an offset
    or a conj/neg bit -- made with view ops only, which every dtype has."""
    how = draw(st.sampled_from(["plain", "transposed", "stepped", "expanded", "offset",
                                "conj", "neg"]))
    shape = tuple(shape)
    if how == "transposed":
        return _random(dtype, shape[::-1]).permute(tuple(reversed(range(len(shape)))))
    if how == "stepped":
        return _random(dtype, shape + (2,))[..., 1]
    if how == "expanded" and shape:
        return _random(dtype, (1,) + shape[1:]).expand(shape)
    if how == "offset":
        return _random(dtype, (torch.Size(shape).numel() + 1,))[1:].view(shape)
    t = _random(dtype, shape)
    if how in ("conj", "neg") and dtype in (torch.complex64, torch.complex128):
        return t.conj() if how == "conj" else t.conj().imag
    return t


@st.composite
def tensors(draw, max_side=4):
    dtype = draw(st.sampled_from(_DTYPES))
    return _laid_out(draw, dtype, draw(st.lists(st.integers(0, max_side), max_size=4)))


@st.composite
def sized(draw):
    """A tensor of about the byte size at one of the limits (64 KiB ring: 32 KiB
    inline; arena limit set to 128 KiB; 1 MiB, far over both)."""
    limit = draw(st.sampled_from([32 << 10, 128 << 10, 1 << 20]))
    n = draw(st.integers(limit - 256, limit + 256))
    dtype = draw(st.sampled_from([torch.uint8, torch.float32, torch.complex128]))
    return _laid_out(draw, dtype, (n // dtype.itemsize,))


_leaves = (tensors() | st.none() | st.booleans() | st.floats(allow_nan=True)
           | st.integers(-(2 ** 70), 2 ** 70) | st.text(max_size=20) | st.binary(max_size=20))
_trees = st.recursive(
    _leaves,
    lambda kids: (st.tuples(kids, kids) | st.lists(kids, max_size=4)
                  | st.dictionaries(st.text(max_size=5), kids, max_size=3)),
    max_leaves=12)


@pytest.fixture
def small_arenas(monkeypatch):
    monkeypatch.setattr(ring_mod, "_ARENA_MAX", 128 << 10)


_PROPS = settings(max_examples=150, deadline=None, database=None,
                  suppress_health_check=[HealthCheck.function_scoped_fixture])


@_PROPS
@given(obj=_trees)
def test_any_pytree_round_trips_exactly(pair, same, obj):
    _round_trip(*pair, obj, same)


@settings(_PROPS, max_examples=40)
@given(obj=sized(), wrap=st.sampled_from(["lone", "tuple", "dict"]))
def test_frames_around_the_ring_and_arena_limits_round_trip(
        pair, same, small_arenas, obj, wrap):
    obj = {"lone": obj, "tuple": (obj, 1), "dict": {"t": obj}}[wrap]
    _round_trip(*pair, obj, same)


@settings(_PROPS, max_examples=20)
@given(obj=sized())
def test_big_inline_frames_round_trip_on_a_big_ring(runtime_dir, same, obj):
    with Ring.create(4 << 20) as owner, Ring.attach(owner.name) as peer:
        _round_trip(owner, peer, obj, same)
        out = torch.empty(obj.shape, dtype=obj.dtype)
        owner.send(obj)
        peer.recv_into(out, timeout=5)
        same(obj, out)


# -- row ranges (codec.Rows): a tensor's chunks sent without views ----------------------
# made by the request path's cutter (neuronmp.session._rowcut, through chunking.row_ranges);
# the transport only sends them


def _spec(t):
    return codec.CODE[t.dtype], tuple(t.shape)


def _cut(t, sizes, code, shape):
    got = chunking.row_ranges([t], sizes, [(code, shape)])
    return None if got is None else got[0]


def test_row_ranges_arrive_as_the_tensors_of_those_rows(pair, next_kind):
    owner, peer = pair
    x = torch.arange(60, dtype=torch.float32).reshape(6, 10)
    parts = _cut(x, [2, 3, 0, 1], *_spec(x))
    assert [type(p) for p in parts] == [codec.Rows] * 4
    assert [p.tensor().shape[0] for p in parts] == [2, 3, 0, 1]
    for part, want in zip(parts, (x[:2], x[2:5], x[5:5], x[5:])):
        owner.send((1, 7, 3, (1, part), 99))
        assert next_kind(peer) == codec.PACKED       # the C codec sent it as a tensor
        got = peer.recv(timeout=5)
        assert got[:3] == (1, 7, 3) and got[4] == 99
        assert type(got[3][1]) is torch.Tensor and torch.equal(got[3][1], want)


def test_row_ranges_on_the_pickle_and_spill_paths_arrive_as_tensors(pair, next_kind):
    owner, peer = pair
    x = torch.arange(24.0).reshape(4, 6)
    part = _cut(x, [1, 3], *_spec(x))[1]
    owner.send({"rows": part})                       # a dict: pickled, the rows a tensor
    assert next_kind(peer) == codec.PICKLED
    got = peer.recv(timeout=5)
    assert type(got["rows"]) is torch.Tensor and torch.equal(got["rows"], x[1:])
    forged = codec.Rows((b"not a description", x, 1, 3))   # its pointer is not trusted
    owner.send((1, forged))
    assert next_kind(peer) == codec.PICKLED
    assert torch.equal(peer.recv(timeout=5)[1], x[1:])
    big = torch.rand(4096, 8)                        # 128 KiB rows > half the ring: spilled
    part = _cut(big, [1024, 3072], *_spec(big))[1]
    owner.send((1, part))
    assert next_kind(peer) in (codec.SPILL, codec.ARENA)
    got = peer.recv(timeout=5)
    assert torch.equal(got[1], big[1024:])


def test_the_encoder_trusts_a_description_only_with_its_own_tensor(pair, next_kind):
    owner, peer = pair
    x = torch.arange(24.0).reshape(4, 6)
    part = _cut(x, [1, 3], *_spec(x))[1]
    other = torch.zeros(4, 6)
    swapped = codec.Rows((part[0], other, 1, 3))   # a real description, another tensor
    owner.send((1, swapped))
    assert next_kind(peer) == codec.PICKLED          # sent as Rows.tensor(): other's rows
    assert torch.equal(peer.recv(timeout=5)[1], other[1:])


def test_a_row_range_description_holds_its_tensor():
    x = torch.arange(12.0).reshape(6, 2)
    parts = _cut(x, [2, 4], *_spec(x))
    alive = weakref.ref(x)
    description = parts[1][0]
    del x, parts
    assert alive() is not None, "the memory a description points into must live with it"
    del description
    assert alive() is None
