"""One rank of a 2-rank tensor-parallel run on CPU (gloo) for tests/test_train_tensor_parallel.py:
an MLP block split by sftctl.train.tensor_parallel, three AdamW steps in float64, beside the same
model unsplit on this rank (the single-process reference). Rank 0 writes OUT (JSON): the losses of
both, the largest weight difference after the steps, and how each split weight is sharded.

    RANK=r WORLD_SIZE=2 MASTER_ADDR=127.0.0.1 MASTER_PORT=p SFTCTL_TP=2 python tests/tp_worker.py OUT
"""

import copy
import json
import sys

import torch
import torch.distributed as dist

from sftctl.train.tensor_parallel import apply_tensor_parallel, tensor_parallel_degree


class Block(torch.nn.Module):
    def __init__(self, d: int = 16, f: int = 64) -> None:
        super().__init__()
        self.norm = torch.nn.LayerNorm(d)
        self.up = torch.nn.Linear(d, f)
        self.down = torch.nn.Linear(f, d)

    def forward(self, x):
        return x + self.down(torch.nn.functional.gelu(self.up(self.norm(x))))


def main(out: str) -> None:
    dist.init_process_group("gloo")
    torch.manual_seed(0)
    ref = torch.nn.Sequential(Block(), Block()).double()
    model = copy.deepcopy(ref)
    model = apply_tensor_parallel(model, tensor_parallel_degree(), device_type="cpu")
    opt_ref = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    gen = torch.Generator().manual_seed(1)
    losses, ref_losses = [], []
    for _ in range(3):
        x = torch.randn(8, 16, dtype=torch.float64, generator=gen)
        y = torch.randn(8, 16, dtype=torch.float64, generator=gen)
        for m, o, log in ((ref, opt_ref, ref_losses), (model, opt, losses)):
            o.zero_grad()
            loss = torch.nn.functional.mse_loss(m(x), y)
            loss.backward()
            o.step()
            log.append(float(loss.detach()))
    from torch.distributed.tensor import DTensor

    diff, shards = 0.0, {}
    ref_params = dict(ref.named_parameters())
    for name, p in model.named_parameters():
        full = p.full_tensor() if isinstance(p, DTensor) else p
        diff = max(diff, float((full.detach() - ref_params[name].detach()).abs().max()))
        if isinstance(p, DTensor):
            shards[name] = [f"shard{pl.dim}" if pl.is_shard() else str(pl) for pl in p.placements] + [
                list(p.to_local().shape)]
    if dist.get_rank() == 0:
        with open(out, "w") as f:
            json.dump({"losses": losses, "ref_losses": ref_losses, "max_weight_diff": diff, "shards": shards}, f)
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1])
