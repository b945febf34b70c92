"""sftctl.train.tensor_parallel (issue 38 item 3): an MLP split by DTensor's parallelize_module
over 2 CPU ranks (gloo) trains as the unsplit float64 reference does, each split weight holding
half its rows or columns; a model with nothing to split, or a tp that is not the world, is one
clear SpecError."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_two_rank_tensor_parallel_matches_the_float64_reference(tmp_path):
    out = tmp_path / "tp.json"
    port = str(_free_port())
    procs = []
    for rank in range(2):
        env = {**os.environ, "RANK": str(rank), "WORLD_SIZE": "2", "LOCAL_RANK": str(rank),
               "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": port, "SFTCTL_TP": "2", "OMP_NUM_THREADS": "1"}
        procs.append(subprocess.Popen([sys.executable, str(HERE / "tp_worker.py"), str(out)], env=env,
                                      stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
    logs = [p.communicate(timeout=240)[0] for p in procs]
    assert [p.returncode for p in procs] == [0, 0], logs
    got = json.loads(out.read_text())
    assert len(got["losses"]) == 3
    for a, b in zip(got["losses"], got["ref_losses"]):
        assert a == pytest.approx(b, rel=1e-12, abs=1e-14)
    assert got["losses"][0] != got["losses"][2]  # the weights moved
    assert got["max_weight_diff"] < 1e-12
    # Megatron's split: up column-wise (rows of the [out, in] weight), down row-wise (its columns)
    assert got["shards"]["0.up.weight"] == ["shard0", [32, 16]]
    assert got["shards"]["0.down.weight"] == ["shard1", [16, 32]]
    assert got["shards"]["1.up.bias"] == ["shard0", [32]]
    assert "0.norm.weight" not in got["shards"]


def test_a_model_without_named_pairs_or_the_wrong_world_is_one_clear_error():
    import torch

    from sftctl.errors import SpecError
    from sftctl.train.tensor_parallel import apply_tensor_parallel, default_plan, tensor_parallel_degree

    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Linear(8, 4))
    assert default_plan(model) == {}
    with pytest.raises(SpecError, match="needs 2 ranks"):
        apply_tensor_parallel(model, 2)  # no process group: a world of 1
    with pytest.raises(SpecError, match="no Linear named"):
        apply_tensor_parallel(model, 1)
    assert tensor_parallel_degree({"SFTCTL_TP": "4"}) == 4 and tensor_parallel_degree({}) == 1
