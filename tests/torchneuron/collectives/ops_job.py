"""One torchrun job: every collective, reduce op and dtype on the ``neuron`` group
against gloo's result on the same inputs, in the same ranks; prints JSON facts."""
import json
import os

import torch
import torch.distributed as dist

from neuronmp.torchneuron.collectives import pieces, shm

R = dist.ReduceOp
FLOATS = [torch.float32, torch.float16, torch.bfloat16]
INTS = [torch.uint8, torch.int8, torch.int32, torch.int64]

dist.init_process_group("neuron")
rank, world = dist.get_rank(), dist.get_world_size()
local = int(os.environ["LOCAL_RANK"])
gloo = dist.new_group(backend="gloo")
dev = torch.device(f"neuron:{local}")
bad = []


def inputs(dtype, n, salt=0):
    g = torch.Generator().manual_seed(1000 * rank + salt)
    if dtype.is_floating_point:
        return (torch.rand(n, generator=g) * 0.5 + 0.75).to(dtype)
    return torch.randint(0, 7, (n,), generator=g).to(dtype)


def same(name, got, want, rounding=False):
    """Equal bit for bit; ``rounding``: a floating sum or product over more than two
    ranks, which gloo's ring adds in another order: within (n - 1) unit roundoffs
    per operation of the result (the documented bound), and still equal on every rank."""
    got = [g.cpu() for g in got] if isinstance(got, (list, tuple)) else [got.cpu()]
    want = list(want) if isinstance(want, (list, tuple)) else [want]
    for g, w in zip(got, want):
        if g.dtype != w.dtype:
            bad.append(name)
            return
        if rounding and world > 2 and g.dtype.is_floating_point:
            eps = torch.finfo(g.dtype).eps
            ok = torch.allclose(g.double(), w.double(), rtol=2 * (world - 1) * eps, atol=0)
        else:
            ok = torch.equal(g, w)
        if not ok:
            bad.append(name)
            return


def ops_for(dtype):
    ops = [R.SUM, R.PRODUCT, R.MIN, R.MAX]
    if dtype.is_floating_point:
        return ops + [R.AVG, "premul"]
    return ops + [R.BAND, R.BOR, R.BXOR]


def neuron_op(op):
    return dist._make_nccl_premul_sum(0.5) if op == "premul" else op


def gloo_ref(x, op):
    """gloo's all_reduce of x (AVG and PREMUL_SUM as gloo cannot: SUM, then scale)."""
    y = x.clone()
    if op == "premul":
        y.mul_(0.5)
    dist.all_reduce(y, op=R.SUM if op in (R.AVG, "premul") else op, group=gloo)
    if op == R.AVG:
        y.div_(world)
    return y


# all_reduce: every op and dtype, one small tensor and one spanning several rounds
for dtype in FLOATS + INTS:
    for op in ops_for(dtype):
        for n in (5, 50_001):
            x = inputs(dtype, n, n)
            t = x.to(dev)
            dist.all_reduce(t, op=neuron_op(op))
            same(f"all_reduce {op} {dtype} {n}", t, gloo_ref(x, op),
                 rounding=op in (R.SUM, R.PRODUCT, R.AVG, "premul"))
    # reduce_scatter_tensor and reduce (SUM and MAX) per dtype
    for op in (R.SUM, R.MAX):
        x = inputs(dtype, 4 * world * 3001, 7)
        out = torch.empty(4 * 3001, dtype=dtype, device=dev)
        dist.reduce_scatter_tensor(out, x.to(dev), op=op)
        same(f"reduce_scatter_tensor {op} {dtype}", out, gloo_ref(x, op).chunk(world)[rank],
             rounding=True)
        t = x.to(dev)
        dist.reduce(t, dst=1, op=op)
        ref = gloo_ref(x, op)   # a collective: every rank calls it
        same(f"reduce {op} {dtype}", t, ref if rank == 1 else x, rounding=rank == 1)

# all_reduce of tensors the device allocated shareable (a MiB or more): reduced where
# they live, every op and dtype, async too; then a rank whose tensor is not shareable
# (a strided view: reduced from a copy) sends every rank the segment's way
shm_group = dist.group.WORLD._shm
before = shm_group.in_place_reduces
for dtype in FLOATS + INTS:
    n = torch.neuron.shared_min() // dtype.itemsize + 3
    for op in ops_for(dtype):
        x = inputs(dtype, n, 5)
        t = x.to(dev)
        dist.all_reduce(t, op=neuron_op(op))
        same(f"all_reduce in place {op} {dtype}", t, gloo_ref(x, op),
             rounding=op in (R.SUM, R.PRODUCT, R.AVG, "premul"))
    # reduce_scatter_tensor reads the ranks' inputs where they live too
    for op in (R.SUM, R.MIN, R.AVG if dtype.is_floating_point else R.MAX):
        x = inputs(dtype, world * n, 12)
        out = torch.empty(n, dtype=dtype, device=dev)
        dist.reduce_scatter_tensor(out, x.to(dev), op=op)
        same(f"reduce_scatter_tensor in place {op} {dtype}", out,
             gloo_ref(x, op).chunk(world)[rank], rounding=op in (R.SUM, R.AVG))
w = inputs(torch.float32, world * ((1 << 18) + 5), 13)
big = w.to(dev)   # FSDP's way: the output is this rank's chunk of the input
dist.reduce_scatter_tensor(big.chunk(world)[rank], big)
same("reduce_scatter_tensor its own chunk, in place", big.chunk(world)[rank],
     gloo_ref(w, R.SUM).chunk(world)[rank], rounding=True)
x = inputs(torch.float32, (1 << 18) + 5, 6)
t = x.to(dev)
work_big = dist.all_reduce(t, async_op=True)
same("all_reduce in place async", work_big.result()[0], gloo_ref(x, R.SUM), rounding=True)
big_waited = work_big.wait()
# the fixed split's sizes (float16 takes it: each rank reduces its slice a piece at a
# time and copies each piece into its peers'): slices of whole pieces, one element
# either side, and a piece and a bit
split = 0
for dtype in (torch.float32, torch.float16, torch.int64):
    per = shm._PIECE // dtype.itemsize
    for n in (world * 2 * per - 1, world * 2 * per, world * 2 * per + 1, world * per + 7):
        for op in (R.SUM, R.AVG, R.MAX) if dtype.is_floating_point else (R.SUM, R.MAX):
            x = inputs(dtype, n, 14)
            t = x.to(dev)
            dist.all_reduce(t, op=op)
            same(f"all_reduce in place by pieces {op} {dtype} {n}", t, gloo_ref(x, op),
                 rounding=op in (R.SUM, R.AVG))
            split += 1
mapped = shm_group.in_place_reduces - before
mapped_expected = sum(len(ops_for(d)) + 3 for d in FLOATS + INTS) + 2 + split
wide = inputs(torch.float32, 2 * ((1 << 18) + 5), 8).to(dev)
t = wide[: (1 << 18) + 5] if rank == 0 else wide[::2]
x = t.cpu()
dist.all_reduce(t, op=R.MAX)
same("all_reduce one rank strided", t, gloo_ref(x, R.MAX))
mapped_mixed = shm_group.in_place_reduces - before - mapped

def cpu_ref(x, op):
    """The all_reduce of x reduced here in rank order with torch's ops, for a dtype
    gloo does not reduce (int16): every rank's bytes gathered through gloo."""
    raw = [torch.empty(x.numel() * x.element_size(), dtype=torch.uint8) for _ in range(world)]
    dist.all_gather(raw, x.view(torch.uint8), group=gloo)
    parts = [r.view(x.dtype) for r in raw]
    fn = {R.SUM: torch.add, R.PRODUCT: torch.mul, R.MIN: torch.minimum, R.MAX: torch.maximum,
          R.BAND: torch.bitwise_and, R.BOR: torch.bitwise_or, R.BXOR: torch.bitwise_xor}[op]
    out = parts[0]
    for part in parts[1:]:
        out = fn(out, part)
    return out


# mapped all_reduces by claimed pieces (the dtypes the kernels know): sizes not
# divisible by the ranks nor by a piece, every op; each piece reduced by one rank only
# (the job's ranks sum their counts); float16, which has no kernel, by the fixed split
claimed = {"before": shm_group.pieces_reduced, "expected": 0}
for dtype in (torch.float32, torch.float64, torch.int16, torch.uint8, torch.int64,
              torch.bfloat16, torch.float16):
    per = pieces.PIECE_BYTES // dtype.itemsize
    for n in (4 * per + 1, 5 * per - 1, 6 * per + world + 1):
        for op in ops_for(dtype):
            x = inputs(dtype, n, 15)
            t = x.to(dev)
            dist.all_reduce(t, op=neuron_op(op))
            ref = cpu_ref(x, op) if dtype == torch.int16 else gloo_ref(x, op)
            same(f"all_reduce by claimed pieces {op} {dtype} {n}", t, ref,
                 rounding=op in (R.SUM, R.PRODUCT, R.AVG, "premul"))
            if dtype != torch.float16:
                claimed["expected"] += -(-n // per)
claimed = [shm_group.pieces_reduced - claimed["before"], claimed["expected"]]

# data movement, two dtypes, a size spanning several rounds
for dtype in (torch.float32, torch.bfloat16, torch.int64):
    x = inputs(dtype, 40_003, 3)
    t = x.to(dev)
    ref = x.clone()
    dist.broadcast(t, src=1)
    dist.broadcast(ref, src=1, group=gloo)
    same(f"broadcast {dtype}", t, ref)

    outs = [torch.empty_like(x, device=dev) for _ in range(world)]
    refs = [torch.empty_like(x) for _ in range(world)]
    dist.all_gather(outs, x.to(dev))
    dist.all_gather(refs, x, group=gloo)
    same(f"all_gather {dtype}", outs, refs)

    big = torch.empty(world * x.numel(), dtype=dtype, device=dev)
    dist.all_gather_into_tensor(big, x.to(dev))
    same(f"all_gather_into_tensor {dtype}", big, torch.cat(refs))

    ins = [inputs(dtype, 40_003, 10 + j) for j in range(world)]
    outs = [torch.empty_like(x, device=dev) for _ in range(world)]
    dist.reduce_scatter(outs[0], [i.to(dev) for i in ins])
    same(f"reduce_scatter {dtype}", outs[0], gloo_ref(torch.cat(ins), R.SUM).chunk(world)[rank],
         rounding=True)

    a2a = [torch.empty_like(x, device=dev) for _ in range(world)]
    a2a_ref = [torch.empty_like(x) for _ in range(world)]
    dist.all_to_all(a2a, [i.to(dev) for i in ins])
    dist.all_to_all(a2a_ref, ins, group=gloo)
    same(f"all_to_all {dtype}", a2a, a2a_ref)

    single = torch.empty(world * x.numel(), dtype=dtype, device=dev)
    single_ref = torch.empty(world * x.numel(), dtype=dtype)
    dist.all_to_all_single(single, torch.cat(ins).to(dev))
    dist.all_to_all_single(single_ref, torch.cat(ins), group=gloo)
    same(f"all_to_all_single {dtype}", single, single_ref)

    g = [torch.empty_like(x, device=dev) for _ in range(world)] if rank == 0 else None
    g_ref = [torch.empty_like(x) for _ in range(world)] if rank == 0 else None
    dist.gather(x.to(dev), g, dst=0)
    dist.gather(x, g_ref, dst=0, group=gloo)
    if rank == 0:
        same(f"gather {dtype}", g, g_ref)

    s = torch.empty_like(x, device=dev)
    s_ref = torch.empty_like(x)
    dist.scatter(s, [i.to(dev) for i in ins] if rank == 1 else None, src=1)
    dist.scatter(s_ref, ins if rank == 1 else None, src=1, group=gloo)
    same(f"scatter {dtype}", s, s_ref)

# the coalesced forms, called on the group as the FSDP/DDP machinery calls them
pg = dist.distributed_c10d._get_default_group()
xs = [inputs(torch.float32, n, n) for n in (3, 30_000)]
ts = [x.to(dev) for x in xs]
pg.allreduce_coalesced(ts, dist.AllreduceCoalescedOptions()).wait()
same("all_reduce_coalesced", ts, [gloo_ref(x, R.SUM) for x in xs], rounding=True)
outs = [torch.empty(world * x.numel(), device=dev) for x in xs]
pg.allgather_into_tensor_coalesced(outs, [x.to(dev) for x in xs]).wait()
refs = []
for x in xs:
    r = torch.empty(world * x.numel())
    dist.all_gather_into_tensor(r, x, group=gloo)
    refs.append(r)
same("all_gather_into_tensor_coalesced", outs, refs)
wide = [inputs(torch.float32, world * n, n) for n in (4, 30_000)]
outs = [torch.empty(w.numel() // world, device=dev) for w in wide]
pg.reduce_scatter_tensor_coalesced(outs, [w.to(dev) for w in wide],
                                   dist.ReduceScatterOptions()).wait()
same("reduce_scatter_tensor_coalesced", outs,
     [gloo_ref(w, R.SUM).chunk(world)[rank] for w in wide], rounding=True)

# in place, as FSDP calls them: the output is this rank's chunk of the input (the
# engine must not read its own operand after writing the output over it)
for n in (5, 30_000):
    w = inputs(torch.float32, world * n, 7 + n)
    big = w.to(dev)
    dist.reduce_scatter_tensor(big.chunk(world)[rank], big)
    same(f"reduce_scatter_tensor in place {n}", big.chunk(world)[rank],
         gloo_ref(w, R.SUM).chunk(world)[rank], rounding=True)
    x = inputs(torch.float32, n, 11 + n)
    whole = torch.zeros(world * n, device=dev)
    whole.chunk(world)[rank].copy_(x.to(dev))
    dist.all_gather_into_tensor(whole, whole.chunk(world)[rank])
    ref = torch.empty(world * n)
    dist.all_gather_into_tensor(ref, x, group=gloo)
    same(f"all_gather_into_tensor in place {n}", whole, ref)

# back to back: many small all_reduces of values distinct per call and rank, each
# result checked whole, and each call one arrival.  A rank returns after that one
# arrival, so it writes its slot again while a peer may still be reducing: a torn
# read (a call's operand overwritten by the next call's) shows as a wrong sum here
n = 16384 if world == 2 else 2048   # one round every rank reduces whole
t = torch.empty(n, device=dev)
torn, calls = [], 600
arrivals = dist.group.WORLD._shm._gen
for i in range(calls):
    t.fill_(float(i * world + rank))
    dist.all_reduce(t)
    want = float(i * world * world + world * (world - 1) // 2)
    if not bool(t.eq(want).all()):
        torn.append(i)
arrivals = dist.group.WORLD._shm._gen - arrivals

# async Work: done on return, as TorchNeuron's after wait()
t = torch.full((4,), float(rank + 1), device=dev)
work = dist.all_reduce(t, async_op=True)
waited = work.wait()
result = work.result()
fut = work.get_future().wait()
dist.barrier()

# bad input: a clear error where the mistake was made, every rank alike
from neuronmp.errors import CollectiveUsageError  # noqa: E402

refused = {}
try:
    dist.all_reduce(torch.ones(2, device=dev), op=R.BXOR)
except CollectiveUsageError as exc:
    refused["bxor_float"] = [exc.op, exc.detail]
try:
    dist.all_to_all_single(torch.empty(world + 1, device=dev), torch.ones(world + 1, device=dev),
                           [2] + [1] * (world - 1), [2] + [1] * (world - 1))
except NotImplementedError as exc:
    refused["uneven"] = str(exc)

# neuronmp-top's view of this rank's core across some collectives
from neuronmp.cli import top  # noqa: E402
from neuronmp.host import settings  # noqa: E402

topo = settings.get("topology")
before = top.sample(topo.num_cores)
busy = torch.ones(1 << 16, device=dev)
for _ in range(20):
    dist.all_reduce(busy)
view = top.frame(topo, before, top.sample(topo.num_cores))
core = next(c for c in view["cores"] if c["core"] == local)

try:
    torch.ones(1, device=f"neuron:{(local + 1) % world}")
    other = "no error"
except RuntimeError as exc:
    other = str(exc)

from neuronmp.shm import segment  # noqa: E402


def mine():
    """This rank's segments (the group's, the stats block of its cores)."""
    return [n for n in os.listdir(segment.shm_dir())
            if (segment.owner_of(n) or (0,))[0] == os.getpid()]


held = len(mine())
backend = dist.get_backend()
in_place = dist.group.WORLD._shm._direct   # the larger all_gathers read peers in place
in_place = in_place and dist.group.WORLD._shm._mappable   # and all_reduce maps them
dist.barrier(group=gloo)   # no rank tears gloo down while a peer still uses it
dist.destroy_process_group()
released = {"held": held > 0, "after_destroy": mine()}

# one write of a line shorter than a pipe's atomic size: ranks' lines never interleave
os.write(1, (json.dumps({
    "rank": rank, "bad": bad, "waited": waited, "refused": refused, "released": released,
    "result": [r.cpu().tolist() for r in result], "future": [r.cpu().tolist() for r in fut],
    "is_completed": work.is_completed(), "device_count": torch.neuron.device_count(),
    "device": str(t.device), "other": other, "backend": backend, "in_place": in_place,
    "visible": os.environ.get("NEURON_RT_VISIBLE_CORES"),
    "mapped": [mapped, mapped_expected, mapped_mixed, big_waited],
    "claimed": claimed,
    "back_to_back": {"torn": torn[:5], "arrivals": arrivals, "calls": calls},
    "top": {"held": core["held"], "busy": core["busy_pct"] > 0,
            "requests": core["requests"] >= 20},
}) + "\n").encode())
