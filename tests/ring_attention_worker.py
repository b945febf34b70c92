"""One rank of a 2- or 4-process CPU (gloo) run of sftctl.train.context_parallel.ring_attention for
tests/test_parallel_train.py: causal attention of a float64 ``[1, 2, 32, 8]`` query/key/value cut
by ``shard_sequence`` (the default split, then the contiguous one), forward and backward, against
``F.scaled_dot_product_attention`` on the whole sequence; each rank's attention FLOPs (forward,
torch's FlopCounterMode) measured. Rank 0 writes OUT (JSON): per split, per rank, the largest
absolute error of the output and of the q/k/v gradients and the FLOPs.

    WORLD_SIZE=n MASTER_ADDR=127.0.0.1 MASTER_PORT=p python tests/ring_attention_worker.py OUT
"""

import datetime
import json
import os
import sys

import torch
import torch.distributed as dist
import torch.nn.functional as F
from _ranks import forked  # tests/_ranks.py: this script's folder is on sys.path


def main(out: str) -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.utils.flop_counter import FlopCounterMode

    from sftctl.train.context_parallel import ring_attention, shard_sequence

    torch.set_num_threads(1)
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=300))
    cp = dist.get_world_size()
    mesh = init_device_mesh("cpu", (cp,), mesh_dim_names=("cp",))["cp"]
    gen = torch.Generator().manual_seed(0)
    q, k, v, w = (torch.randn(1, 2, 32, 8, dtype=torch.float64, generator=gen) for _ in range(4))
    full = [t.clone().requires_grad_() for t in (q, k, v)]
    ref = F.scaled_dot_product_attention(*full, is_causal=True)
    (ref * w).sum().backward()
    results = {}
    for split, kw in (("default", {}), ("contiguous", {"load_balance": False})):
        local = [shard_sequence(t, mesh, dim=2, **kw).clone().requires_grad_() for t in (q, k, v)]
        with FlopCounterMode(display=False) as counter:
            got = ring_attention(*local, mesh.get_group(), is_causal=True, **kw)
        (got * shard_sequence(w, mesh, dim=2, **kw)).sum().backward()
        errs = [float((got - shard_sequence(ref.detach(), mesh, dim=2, **kw)).abs().max())]
        errs += [float((a.grad - shard_sequence(b.grad, mesh, dim=2, **kw)).abs().max()) for a, b in zip(local, full)]
        results[split] = {"errors": errs, "flops": counter.get_total_flops()}
    every = [None] * cp
    dist.all_gather_object(every, results)
    if dist.get_rank() == 0:
        with open(out, "w") as f:
            json.dump(every, f)
    dist.destroy_process_group()


if __name__ == "__main__":
    sys.exit(forked(int(os.environ["WORLD_SIZE"]), lambda: main(sys.argv[1])))
