"""Ranks arriving apart, as they do after a backward pass: before every call each rank
sleeps a random while of its own (none, a few microseconds, up to milliseconds), so
any rank may come first or last.  Each call's values are distinct per call and rank
and every result is checked whole (an exact sum); prints one JSON line per rank.
argv: the number of calls."""
import json
import random
import time

import torch
import torch.distributed as dist

torch.set_num_threads(1)
dist.init_process_group("neuron")
rank, world = dist.get_rank(), dist.get_world_size()
calls = int(__import__("sys").argv[1])
shm = dist.group.WORLD._shm
dev = torch.device("neuron")
pause = random.Random(rank * 7919 + 1)
# (run with a 64 KiB slot) a one-round all_reduce, which the last rank to arrive
# reduces; one of several rounds through the segment; one of shareable tensors
# reduced where they live
sizes = [16384 if world == 2 else 2048, (shm.slot // 4) * 2 + 5, (1 << 20) // 4 + 3]
tensors = [torch.empty(n, device=dev) for n in sizes]
wrong, last0 = [], shm.reduced_last
small = 0
for i in range(calls):
    delay = pause.choice([0.0, 0.0, 20e-6, 100e-6, 400e-6, 2e-3])
    if delay:
        time.sleep(delay)
    k = 0 if i % 10 else 1 + (i // 10) % 2
    t = tensors[k]
    t.fill_(float(i * world + rank))
    if k == 0:
        t[i % t.numel()] += 1.0   # one element apart: a result copied whole from elsewhere
        small += 1
    dist.all_reduce(t)
    want = float(i * world * world + world * (world - 1) // 2)
    got = t.cpu()
    if k == 0:
        odd = i % t.numel()
        ok = got[odd].item() == want + world and bool(got[:odd].eq(want).all()) and \
            bool(got[odd + 1:].eq(want).all())
    else:
        ok = bool(got.eq(want).all())
    if not ok:
        wrong.append(i)
    if i % 25 == 24:
        dist.barrier()   # another collective between, on the same arrivals
print(json.dumps({"rank": rank, "wrong": wrong[:5], "small": small,
                  "reduced_last": shm.reduced_last - last0,
                  "caught": shm.waits_caught, "slept": shm.waits_slept}), flush=True)
dist.destroy_process_group()
