"""One job of four ranks, spawned here with init_method env:// as the suite's tester
spawns them (so world rank 0's process hosts the store, unlike torchrun's, whose agent
hosts it): sub-groups made with ``new_group``.  The members of a group of two and of
three all_to_all in it, the pair all_to_all_single too (TorchNeuron refuses
them); then ranks 2 and 3 all_gather in a
group that leaves out rank 0 while ranks 0 and 1 go straight to
destroy_process_group and exit.  Each rank writes what it saw in its own file.
argv: the directory for the ranks' files, a free port."""
import json
import os
import sys
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

WORLD = 4


def exchange(rank, dev, ranks, single=False):
    group = dist.new_group(ranks)
    if rank not in ranks:
        return None
    n = len(ranks)
    try:
        if single:
            dist.all_to_all_single(torch.zeros(n, device=dev), torch.ones(n, device=dev),
                                   group=group)
        else:
            dist.all_to_all([torch.zeros(2, device=dev) for _ in range(n)],
                            [torch.ones(2, device=dev) for _ in range(n)], group=group)
    except Exception as exc:   # what the rank raised is the test's fact
        return {"raised": type(exc).__name__, "msg": str(exc),
                "runtime": isinstance(exc, RuntimeError), "value": isinstance(exc, ValueError)}
    return {"raised": None}


def rank_main(rank, out_dir, port):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=port, WORLD_SIZE=str(WORLD),
                      LOCAL_WORLD_SIZE=str(WORLD), RANK=str(rank), LOCAL_RANK=str(rank))
    dist.init_process_group("neuron")
    dev = torch.device(f"neuron:{rank}")
    facts = {"pair": exchange(rank, dev, [0, 1]), "three": exchange(rank, dev, [0, 1, 2]),
             "pair_single": exchange(rank, dev, [0, 1], single=True)}
    group = dist.new_group([2, 3])
    if rank in (2, 3):
        time.sleep(1)   # ranks 0 and 1 are at destroy_process_group (or gone) by now
        outs = [torch.zeros(2, dtype=torch.long, device=dev) for _ in range(2)]
        dist.all_gather(outs, torch.tensor([10 * rank, 10 * rank + 1], device=dev),
                        group=group)
        facts["gathered"] = [o.cpu().tolist() for o in outs]
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
        json.dump(facts, f)
    dist.destroy_process_group()


if __name__ == "__main__":
    mp.spawn(rank_main, args=(sys.argv[1], sys.argv[2]), nprocs=WORLD, join=True)
