"""``ProcessGroupNeuron``: the ``neuron`` backend of torch.distributed.

    dist.init_process_group("neuron")  (env://, torchrun's rendezvous: c10d's own)
      └─▶ create(store, rank, size, timeout)
            rank rules       NEURON_RT_VISIBLE_CORES=LOCAL_RANK unless set; the runtime
                             must not have started; device_count() = LOCAL_WORLD_SIZE;
                             this rank attaches to neuron:LOCAL_RANK only
            one host?        every rank posts its node key (host, GROUP_RANK) in the store
              yes ─▶ shm.ShmGroup    (one segment, futex waits; see shm.py)
              no  ─▶ ProcessGroupGloo over TCP on zero-copy CPU views of the tensors
    dist.<collective>(neuron tensors) ─▶ a method below ─▶ a completed Work

Every collective runs to completion in the calling thread (the device is
synchronous), so ``async_op=True`` returns a Work that is already done: ``wait()``
is True, ``result()`` the output tensors, ``get_future()`` a completed Future.
"""
from __future__ import annotations

import socket
import time
from datetime import timedelta
from typing import Callable, List, Optional, Sequence

import torch
import torch.distributed as dist
from torch.futures import Future

from ...errors import CollectiveUsageError
from ...host import runtime, settings
from ...pool.stats import StatsBlock
from . import calls, checks, shm

RO = dist.ReduceOp.RedOpType


def _binary(fn) -> Callable:
    """``reduce(a, b, out=None)``: ``out = a op b`` in one pass (``a`` when no ``out``)."""
    return lambda a, b, out=None: fn(a, b, out=a if out is None else out)


_FNS = {int(kind): _binary(fn) for kind, fn in (
    (RO.SUM, torch.add), (RO.AVG, torch.add), (RO.PREMUL_SUM, torch.add),
    (RO.PRODUCT, torch.mul), (RO.MIN, torch.minimum), (RO.MAX, torch.maximum),
    (RO.BAND, torch.bitwise_and), (RO.BOR, torch.bitwise_or), (RO.BXOR, torch.bitwise_xor))}
_BITWISE_INT = {int(RO.BAND), int(RO.BOR), int(RO.BXOR)}
_AVG, _PREMUL = int(RO.AVG), int(RO.PREMUL_SUM)


_REDUCERS = {}   # (kind, dtype) -> reduce, for the pairs already accepted


def _reducer(op, dtype: torch.dtype, name: str) -> Callable:
    """``reduce(a, b, out=None)`` for a c10d ReduceOp (AVG and PREMUL_SUM sum here)."""
    kind = int(_kind(op))
    fn = _REDUCERS.get((kind, dtype))
    if fn is None:
        fn = _REDUCERS[kind, dtype] = _check_reducer(kind, dtype, name, op)
    return fn


def _check_reducer(kind: int, dtype: torch.dtype, name: str, op) -> Callable:
    fn = _FNS.get(kind)
    if fn is None:
        raise CollectiveUsageError(name, f"reduce op {op!r} is not supported; accepted: "
                                         "SUM, PRODUCT, MIN, MAX, AVG, BAND, BOR, BXOR, "
                                         "PREMUL_SUM")
    floating = dtype.is_floating_point or dtype.is_complex
    if kind in _BITWISE_INT and floating:
        raise CollectiveUsageError(name, f"{RO(kind).name} needs an integer or bool tensor, "
                                         f"not {dtype}")
    return fn


_CPU = torch.device("cpu")


def _cpu(t: torch.Tensor, size=None, stride=None) -> torch.Tensor:
    """A zero-copy CPU view of a (neuron or CPU) tensor: same bytes, its strides (or
    ``size`` and ``stride`` over the same first element)."""
    if t.device.type == "cpu":
        return t if size is None else t.as_strided(size, stride)
    st = t.untyped_storage()
    alias = torch._C._construct_storage_from_data_pointer(st.data_ptr(), _CPU, st.nbytes())
    return torch.empty(0, dtype=t.dtype).set_(
        alias, t.storage_offset(), t.size() if size is None else size,
        t.stride() if stride is None else stride)


# Flat CPU aliases of contiguous neuron tensors, by (address, elements, dtype): a
# training step hands the same few tensors again and again.  An alias is reused only
# for a live tensor at that very address and size, so it always views that tensor's
# bytes, whichever allocation they belong to now.
_ALIASES = {}


def _flat_alias(t: torch.Tensor) -> torch.Tensor:
    key = (t.data_ptr(), t.numel(), t.dtype)
    flat = _ALIASES.get(key)
    if flat is None:
        if len(_ALIASES) >= 256:
            _ALIASES.clear()
        flat = _ALIASES[key] = _cpu(t, (t.numel(),), (1,))
    return flat


class _Flat:
    """A flat contiguous CPU tensor for a collective, written back on ``done``."""

    __slots__ = ("view", "flat")

    def __init__(self, t: torch.Tensor):
        if t.is_contiguous():
            # the common case: the flat alias straight from the storage, no reshape
            self.view = None
            self.flat = t.view(-1) if t.device.type == "cpu" else _flat_alias(t)
        else:
            self.view = _cpu(t)
            self.flat = self.view.contiguous().reshape(-1)

    def done(self) -> None:
        if self.view is not None:
            self.view.copy_(self.flat.view(self.view.shape))


class _Busy:
    """This rank's cores in neuronmp-top while it runs collectives: a stats block
    (pool/stats.py, the counters neuronmp-top reads) with one slot per core of the
    rank's runtime, written only here -- a collective is one request, its time busy.

    Each slot's counters are one-item views into the block, bumped in place per call
    (a monitor reads them exact at any moment, as it reads a pool's)."""

    def __init__(self):
        self._tried = False
        self._block = None
        self._counts = ()   # (submitted, done, busy_ns) views of every slot

    def counts(self):
        """The slots' counter views; empty until the runtime started (a CPU-only group
        never starts it)."""
        if not self._tried:
            if runtime.is_initialized():
                self._tried = True
                block = self._block = StatsBlock.create(runtime.get_runtime().cores)
                self._counts = tuple(
                    tuple(block.counter(slot, f) for f in ("submitted", "done", "busy_ns"))
                    for slot in range(block.slots))
        return self._counts

    def close(self) -> None:
        self._counts = ()
        if self._block is not None:
            self._block.close()
            self._block = None


def _timed(method):
    """Count the collective as busy time of this rank's cores (see _Busy)."""
    def wrapper(self, *args, **kwargs):
        self._seq += 1   # the group's collectives numbered in call order (Work's number)
        counts = self._busy.counts()
        if not counts:
            return _numbered(method(self, *args, **kwargs), self._seq)
        for submitted, _, _ in counts:
            submitted[0] += 1
        t0 = _now()
        try:
            return _numbered(method(self, *args, **kwargs), self._seq)
        finally:
            dt = _now() - t0
            for _, done, busy in counts:
                done[0] += 1
                busy[0] += dt
    wrapper.__name__ = method.__name__
    wrapper.__doc__ = method.__doc__
    return wrapper


_now = time.perf_counter_ns


def _numbered(work, seq: int):
    work._seq = seq
    return work


class _Done(dist.Work):
    """The Work of a collective that already ran to completion: ``wait()`` True,
    ``result()`` the outputs, ``get_future()`` a completed Future of them (made only
    when asked: a synchronous call only waits)."""

    __slots__ = ("_result", "_fut", "_seq")

    def __init__(self, result):
        super().__init__()
        self._result = result
        self._fut = None
        self._seq = 0

    def get_sequence_number(self) -> int:
        return self._seq

    def wait(self, timeout=None) -> bool:
        return True

    def is_completed(self) -> bool:
        return True

    def is_success(self) -> bool:
        return True

    def exception(self):
        return None

    def synchronize(self) -> None:
        pass

    def result(self):
        return self._result

    def get_future(self) -> Future:
        if self._fut is None:
            self._fut = Future()
            self._fut.set_result(self._result)
        return self._fut


class ProcessGroupNeuron(dist.ProcessGroup):
    """TorchNeuron's process group on an emulated host (see the module docstring)."""

    def __init__(self, store, rank: int, size: int, timeout: timedelta):
        super().__init__(rank, size)
        self._rank, self._size = rank, size
        self._timeout = timeout.total_seconds()
        self._shm: Optional[shm.ShmGroup] = None
        self._gloo = None
        self._busy = _Busy()
        self._seq = 0
        # init_process_group's group, made before the default group is set
        self._world = None if dist.is_initialized() else store
        if _one_host(store, rank, size, self._timeout):
            self._shm = shm.ShmGroup.create(store, rank, size, self._timeout)
        else:
            self._gloo = dist.ProcessGroupGloo(dist.PrefixStore("gloo", store), rank, size,
                                               timeout)

    def getBackendName(self) -> str:
        return "neuron"

    @property
    def _device_types(self):
        # the device torch's object collectives put their bytes on (as TorchNeuron's
        # group says): CPU tensors are refused here
        return [torch.device("neuron")]

    # c10d keeps a group's name in its C++ backends, which a Python group has none
    # of: DeviceMesh (FSDP2) and functional collectives look groups up by it
    _name = ""
    _desc = ""

    def getGroupName(self) -> str:
        return self._name

    def setGroupName(self, name: str) -> None:
        self._name = name

    def getGroupDesc(self) -> str:
        return self._desc

    def setGroupDesc(self, desc: str) -> None:
        self._desc = desc

    @property
    def transport(self) -> str:
        """'shm' among ranks of one host, 'gloo' across hosts."""
        return "shm" if self._shm is not None else "gloo"

    def shutdown(self) -> None:
        """Release the group's segment (destroy_process_group calls it)."""
        if self._shm is not None:
            if self._world is not None:
                self._shm.linger(self._world)
            self._shm.close()
            self._shm = None
        self._gloo = None
        self._busy.close()

    # -- reductions ---------------------------------------------------------------------

    def _pre(self, flat: torch.Tensor, op) -> None:
        if _kind(op) == RO.PREMUL_SUM:
            f = op.factor
            flat.mul_(f.to(flat.device) if isinstance(f, torch.Tensor) else f)

    def _post(self, flat: torch.Tensor, op) -> None:
        if _kind(op) == RO.AVG:
            _average(flat, self._size)

    def _all_reduce_one(self, t: torch.Tensor, op, name: str, root=None) -> None:
        # the per-call path of every small all_reduce: the op's kind as an int once, the
        # checked reducer straight from its cache, no allocator query below its threshold
        kind, dtype = int(_kind(op)), t.dtype
        fn = _REDUCERS.get((kind, dtype)) or self._reducer(op, dtype, name)
        if t.is_contiguous() and t.device.type == "neuron":
            f, flat = None, _flat_alias(t)   # the common case, no _Flat to make
        else:
            f = _Flat(t)
            flat = f.flat
        if kind == _PREMUL:
            self._pre(flat, op)
        if self._gloo is not None:
            gop = dist.ReduceOp.SUM if kind in (_AVG, _PREMUL) else op
            if root is None:
                self._gloo.allreduce([flat], _ar_opts(gop)).wait()
            else:
                self._gloo.reduce([flat], _red_opts(gop, root)).wait()
        else:
            where = None
            if (f is None or f.view is None) and root is None and \
                    flat.numel() * flat.element_size() >= shm.ShmGroup.map_min:
                where = _where(t)
            self._shm.announce(calls.of(name, flat.numel(), dtype, root, kind))
            self._shm.all_reduce(flat, fn, name, root, where, kind)
        if kind == _AVG and (root is None or root == self._rank):
            _average(flat, self._size)
        if f is not None:
            f.done()

    @_timed
    def allreduce(self, tensors, opts=None):
        op = opts.reduceOp if opts is not None else dist.ReduceOp.SUM
        self._check("all_reduce", checks.devices("all_reduce", tensors),
                    checks.not_empty("all_reduce", tensors))
        for t in tensors:
            self._all_reduce_one(t, op, "all_reduce")
        return _Done(list(tensors))

    @_timed
    def allreduce_coalesced(self, tensors, opts=None):
        op = opts.reduceOp if opts is not None else dist.ReduceOp.SUM
        self._check("all_reduce_coalesced", checks.devices("all_reduce_coalesced", tensors))
        for t in tensors:
            if t.numel():   # TorchNeuron leaves the empty ones out of the collective
                self._all_reduce_one(t, op, "all_reduce_coalesced")
        return _Done(list(tensors))

    @_timed
    def reduce(self, tensors, opts):
        self._check("reduce", checks.root("reduce", opts.rootRank, self._size),
                    checks.devices("reduce", tensors), checks.not_empty("reduce", tensors))
        t = tensors[0]
        if self._rank != opts.rootRank:
            t = t.clone()   # gloo leaves a non-root's input as it was; so do we
        self._all_reduce_one(t, opts.reduceOp, "reduce", root=opts.rootRank)
        return _Done(list(tensors))

    # -- data movement ----------------------------------------------------------------

    @_timed
    def broadcast(self, tensors, opts):
        self._check("broadcast", checks.devices("broadcast", tensors),
                    checks.root("broadcast", opts.rootRank, self._size)
                    if any(t.numel() for t in tensors) else None)
        for t in _list(tensors):
            f = _Flat(t)
            if self._gloo is not None:
                self._gloo.broadcast([f.flat], _bc_opts(opts.rootRank)).wait()
            else:
                self._shm.announce(calls.of("broadcast", t.numel(), t.dtype, opts.rootRank))
                self._shm.broadcast(f.flat, opts.rootRank)
            f.done()
        return _Done(list(tensors))

    def _gather_into(self, outs: Sequence[torch.Tensor], inp: torch.Tensor, name: str,
                     root: Optional[int] = None) -> None:
        fi = _Flat(inp)
        fo = [_Flat(o) for o in outs]
        if self._gloo is not None:
            if root is None:
                self._gloo.allgather([[o.flat for o in fo]], [fi.flat]).wait()
            else:
                o = [[x.flat for x in fo]] if self._rank == root else []
                self._gloo.gather(o, [fi.flat], _gather_opts(root)).wait()
        else:
            self._shm.announce(calls.of(name, inp.numel(), inp.dtype, root))
            self._shm.all_gather([o.flat for o in fo], fi.flat, name, root)
        for o in fo:
            o.done()

    @_timed
    def allgather(self, output_tensors, input_tensors, opts=None):
        self._check("all_gather", checks.devices("all_gather", input_tensors, output_tensors),
                    checks.dim0("all_gather", input_tensors, output_tensors))
        for outs, inp in zip(output_tensors, input_tensors):
            self._check_equal(outs, inp, "all_gather")
            self._gather_into(outs, inp, "all_gather")
        return _Done(output_tensors)

    @_timed
    def _allgather_base(self, output, input, opts=None):
        name = "all_gather_into_tensor"
        self._check(name, checks.devices(name, input, output),
                    checks.dim0(name, input, output, op=True),
                    checks.gathered_shape(name, output, input, self._size))
        self._check_split(output, input, name)
        self._gather_into(_parts(output, self._size), input, "all_gather_into_tensor")
        return _Done([output])

    all_gather_single = _allgather_base   # the name torch.distributed calls

    def allgather_into_tensor_coalesced(self, outputs, inputs, opts=None):
        for o, i in zip(outputs, inputs):
            if i.numel():   # TorchNeuron leaves the empty ones out of the collective
                self._allgather_base(o, i)
        return _Done(list(outputs))

    all_gather_single_coalesced = allgather_into_tensor_coalesced

    @_timed
    def allgather_coalesced(self, output_lists, input_list, opts=None):
        name = "all_gather_coalesced"
        self._check(name, checks.devices(name, input_list, output_lists),
                    checks.dim0(name, input_list, output_lists, op=True),
                    checks.gathered_lists(name, output_lists, input_list, self._size))
        for outs, inp in zip(output_lists, input_list):
            self._gather_into(outs, inp, "all_gather_coalesced")
        return _Done(output_lists)

    @_timed
    def gather(self, output_tensors, input_tensors, opts):
        self._check("gather", checks.root("gather", opts.rootRank, self._size),
                    checks.devices("gather", input_tensors, output_tensors),
                    checks.dim0("gather", input_tensors, output_tensors, op=True))
        if self._rank == opts.rootRank:
            self._check_equal(output_tensors[0], input_tensors[0], "gather")
        outs = output_tensors[0] if self._rank == opts.rootRank else \
            [torch.empty_like(_cpu(input_tensors[0])) for _ in range(self._size)]
        self._gather_into(outs, input_tensors[0], "gather", root=opts.rootRank)
        return _Done(output_tensors)

    @_timed
    def scatter(self, output_tensors, input_tensors, opts):
        root = opts.rootRank
        self._check("scatter", checks.root("scatter", root, self._size),
                    checks.devices("scatter", output_tensors, input_tensors))
        out = output_tensors[0]
        if self._rank == root:
            self._check_equal(input_tensors[0], out, "scatter")
        fo = _Flat(out)
        fi = [_Flat(t) for t in input_tensors[0]] if self._rank == root else None
        if self._gloo is not None:
            ins = [[x.flat for x in fi]] if fi is not None else []
            self._gloo.scatter([fo.flat], ins, _scatter_opts(root)).wait()
        else:
            self._shm.announce(calls.of("scatter", out.numel(), out.dtype, root))
            self._shm.scatter(fo.flat, [x.flat for x in fi] if fi else None, root)
        fo.done()
        return _Done(output_tensors)

    def _exchange(self, outs, ins, op, name: str, numel: Optional[int] = None) -> None:
        """``numel``: the element count the call announces (``ins[0]``'s unless told)."""
        fn = None if op is None else self._reducer(op, ins[0].dtype, name)
        fi = [_Flat(t) for t in ins]
        fo = [_Flat(t) for t in outs]
        if _kind(op) == RO.PREMUL_SUM:
            for x in fi:
                x.flat = x.flat.clone()   # the inputs stay as the caller gave them
                self._pre(x.flat, op)
        if self._gloo is not None:
            self._gloo_exchange(fo, fi, op)
        else:
            self._shm.announce(calls.of(name, ins[0].numel() if numel is None else numel,
                                        ins[0].dtype, None,
                                        None if op is None else int(_kind(op))))
            self._shm.exchange([o.flat for o in fo], [x.flat for x in fi], fn, name)
        if op is not None:
            self._post(fo[0].flat, op)
        for o in fo:
            o.done()

    def _reduce_scatter_mapped(self, output, input, op) -> bool:
        """reduce_scatter_tensor reading the ranks' inputs where they live, when every
        rank's is shareable (PREMUL_SUM, which scales a copy of the input, never is)."""
        name = "reduce_scatter_tensor"
        shm_group = self._shm
        if shm_group is None or not shm_group._mappable or _kind(op) == RO.PREMUL_SUM or \
                input.numel() * input.element_size() < shm_group.map_min:
            return False
        fn = self._reducer(op, input.dtype, name)
        shm_group.announce(calls.of(name, output.numel(), input.dtype, None, int(_kind(op))))
        fi, fo = _Flat(input), _Flat(output)
        where = _where(input) if fi.view is None and fo.view is None else None
        if not shm_group.reduce_scatter(fo.flat, fi.flat, where, fn, name):
            return False
        self._post(fo.flat, op)
        fo.done()
        return True

    def _gloo_exchange(self, fo, fi, op) -> None:
        if op is None:
            self._gloo.alltoall([o.flat for o in fo], [x.flat for x in fi]).wait()
            return
        # gloo's reduce_scatter: all_reduce of the whole, keep this rank's part
        whole = torch.cat([x.flat for x in fi])
        gop = dist.ReduceOp.SUM if _kind(op) in (RO.AVG, RO.PREMUL_SUM) else op
        self._gloo.allreduce([whole], _ar_opts(gop)).wait()
        fo[0].flat.copy_(whole.chunk(self._size)[self._rank])

    @_timed
    def reduce_scatter(self, output_tensors, input_tensors, opts=None):
        op = opts.reduceOp if opts is not None else dist.ReduceOp.SUM
        self._check("reduce_scatter", checks.scatter_call("reduce_scatter", _kind(op),
                                                          output_tensors, input_tensors))
        for out, ins in zip(output_tensors, input_tensors):
            if len(ins) == 1 and self._size > 1:
                # TorchNeuron's one-tensor form: the ranks' parts along one dim
                shape, dim, exc = checks.scattered("reduce_scatter", ins[0], out, self._size)
                self._check("reduce_scatter", exc)
                ins = list(ins[0].reshape(shape).chunk(self._size, dim))
            self._check_equal(ins, out, "reduce_scatter")
            self._exchange([out], ins, op, "reduce_scatter")
        return _Done(list(output_tensors))

    @_timed
    def _reduce_scatter_base(self, output, input, opts=None):
        op = opts.reduceOp if opts is not None else dist.ReduceOp.SUM
        name = "reduce_scatter_tensor"
        self._check(name, checks.scatter_call(name, _kind(op), input, output),
                    checks.scatter_sizes(name, input, output, self._size))
        self._check_split(input, output, name)
        if self._reduce_scatter_mapped(output, input, op):
            return _Done([output])
        self._exchange([output], _parts(input, self._size), op, name)
        return _Done([output])

    reduce_scatter_single = _reduce_scatter_base   # the name torch.distributed calls

    def reduce_scatter_tensor_coalesced(self, outputs, inputs, opts=None):
        name = "reduce_scatter_tensor"   # the collective its pairs announce
        self._check(name, checks.rows_alike(name, [i for i in inputs if i.numel()]))
        for o, i in zip(outputs, inputs):
            self._reduce_scatter_base(o, i, opts)
        return _Done(list(outputs))

    reduce_scatter_single_coalesced = reduce_scatter_tensor_coalesced

    @_timed
    def alltoall(self, output_tensors, input_tensors, opts=None):
        self._check("all_to_all", checks.devices("all_to_all", output_tensors, input_tensors),
                    checks.exchange_groups("all_to_all", dist.get_process_group_ranks(self),
                                           dist.get_world_size()),
                    checks.exchanged("all_to_all", input_tensors, self._size))
        self._check_equal(output_tensors, output_tensors[0], "all_to_all")
        self._check_equal(input_tensors, output_tensors[0], "all_to_all")
        self._exchange(output_tensors, input_tensors, None, "all_to_all")
        return _Done(list(output_tensors))

    @_timed
    def alltoall_base(self, output, input, output_split_sizes, input_split_sizes, opts=None):
        name = "all_to_all_single"   # TorchNeuron's order: the splits, then alltoall's
        self._check(name, checks.split_sizes(output_split_sizes, "output", output, self._size),
                    checks.split_sizes(input_split_sizes, "input", input, self._size),
                    checks.devices(name, output, input),
                    checks.exchange_groups(name, dist.get_process_group_ranks(self),
                                           dist.get_world_size()))
        self._check_split(input, output, name, equal=True)
        self._exchange(_parts(output, self._size), _parts(input, self._size), None,
                       "all_to_all_single", input.numel())
        return _Done([output])

    all_to_all_single = alltoall_base

    @_timed
    def barrier(self, opts=None):
        if self._gloo is not None:
            self._gloo.barrier().wait()
        else:
            self._shm.announce(calls.of("barrier"))
            self._shm.barrier("barrier")
        return _Done([])

    # -- argument checks ----------------------------------------------------------------

    def _refuse(self, name: str, exc: Exception) -> Exception:
        """``exc``, for arguments of this rank's own that do not fit, once announced to
        the peers: where they meet the refusal they raise CollectiveMismatchError
        naming this rank, instead of waiting for it until the timeout."""
        if self._shm is not None:
            self._shm.refuse(calls.refused(name, getattr(exc, "detail", None) or str(exc)),
                             name)
        return exc

    def _check(self, name: str, *errors: Optional[Exception]) -> None:
        """Raise the first of ``errors`` (the checks' findings) once refused."""
        for exc in errors:
            if exc is not None:
                raise self._refuse(name, exc)

    def _reducer(self, op, dtype: torch.dtype, name: str) -> Callable:
        try:
            return _reducer(op, dtype, name)
        except CollectiveUsageError as exc:
            raise self._refuse(name, exc) from None

    def _check_equal(self, many, one, name: str) -> None:
        if len(many) != self._size:
            raise self._refuse(name, CollectiveUsageError(
                name, f"expected a list of {self._size} tensors (the group's size), got "
                      f"{len(many)}"))
        for t in many:
            if t.numel() != one.numel() or t.dtype != one.dtype:
                raise self._refuse(name, CollectiveUsageError(
                    name, f"every tensor must match {tuple(one.shape)} {one.dtype}, got "
                          f"{tuple(t.shape)} {t.dtype}"))

    def _check_split(self, big, small, name: str, equal: bool = False) -> None:
        want = small.numel() if equal else small.numel() * self._size
        if big.numel() != want or big.dtype != small.dtype:
            raise self._refuse(name, CollectiveUsageError(
                name, f"sizes do not fit a group of {self._size}: {big.numel()} {big.dtype} "
                      f"elements against {small.numel()} {small.dtype}"))


def _parts(t: torch.Tensor, size: int) -> List[torch.Tensor]:
    """``t``'s ``size`` rank parts in its element order (a contiguous tensor's flat
    chunks, so a (1, n) tensor splits too; else along dim 0)."""
    return list((t.view(-1) if t.is_contiguous() else t).chunk(size))


def _where(t: torch.Tensor) -> Optional[shm.Where]:
    """Where a contiguous tensor lives for a peer to map it, if it may (see shm.Where)."""
    if t.device.type != "neuron" or t.numel() * t.element_size() < shm.ShmGroup.map_min:
        return None
    from .. import device

    return device.shared_block(t)


def _average(flat: torch.Tensor, size: int) -> None:
    """The sum divided by the group's size in its own dtype: integers truncated toward
    zero, as TorchNeuron's division of an integer tensor does."""
    if flat.dtype.is_floating_point or flat.dtype.is_complex:
        flat.div_(size)
    else:
        flat.div_(size, rounding_mode="trunc")


def _kind(op):
    """The RedOpType of a ReduceOp (which carries PREMUL_SUM's factor) or of itself
    (torch passes both; ``isinstance`` cannot tell them apart)."""
    return getattr(op, "op", op)


def _list(tensors) -> List[torch.Tensor]:
    return list(tensors)


def _ar_opts(op):
    o = dist.AllreduceOptions()
    o.reduceOp = op
    return o


def _red_opts(op, root):
    o = dist.ReduceOptions()
    o.reduceOp = op
    o.rootRank = root
    return o


def _bc_opts(root):
    o = dist.BroadcastOptions()
    o.rootRank = root
    return o


def _gather_opts(root):
    o = dist.GatherOptions()
    o.rootRank = root
    return o


def _scatter_opts(root):
    o = dist.ScatterOptions()
    o.rootRank = root
    return o


def _node_key() -> str:
    # GROUP_RANK tells torchrun's (and neuronmp-run's) nodes apart even on one machine
    return f"{socket.gethostname()}/{settings.get('group_rank')}"


def _one_host(store, rank: int, size: int, timeout: float) -> bool:
    store.set(f"nmp_node/{rank}", _node_key())
    keys = [f"nmp_node/{r}" for r in range(size)]
    store.wait(keys, timedelta(seconds=timeout))
    return len({store.get(k) for k in keys}) == 1
