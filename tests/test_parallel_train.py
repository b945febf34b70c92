"""Issue 38 item 3, on CPU with gloo: a tiny Llama trained 20 AdamW steps in float64 with TP2 x DP2,
PP2 x DP2 (1F1B, 2 micro-batches; and interleaved 1F1B, 2 chunks per rank), TP2 x PP2 and CP2 x DP2 (ring attention), and a tiny MoE with
EP2 (x DP4, and x TP2 x DP2), over 4 processes, reaches at every step the loss of the same model trained unsplit in one process
on the whole batch (tests/parallel_train_worker.py computes both). A DCP checkpoint written under
TP2 x DP2 after 10 steps resumes under DP4 (and one written under PP2 x DP2 under TP2 x DP2), and the
next 10 steps match the reference's steps 11-20.

Tolerance: relative 1e-9 on every step's loss. Everything is float64; the split runs differ from the
reference only in the order of floating-point sums (all-reduces, sharded matmuls, the ring's
log-sum-exp merge), about 1e-16 relative per operation, grown through 20 Adam steps; the measured
largest difference is 4.4e-16 (at load 14 on 2 cores), so 1e-9 leaves room and a wrong split (a missing
gradient average, a shifted position, a dropped token) moves the loss by far more (> 1e-3).
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import deadline

HERE = Path(__file__).resolve().parent
WORKER = HERE / "parallel_train_worker.py"
REL = 1e-9


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch(out: Path, layout: dict[str, int], *args: str, nproc: int = 4) -> dict:
    """Run the worker as ``nproc`` local gloo ranks with ``layout`` as SFTCTL_* settings (one
    process that imports torch once and forks the ranks, see ``forked`` there); the rank-0 JSON."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("SFTCTL_")}
    env.update({"WORLD_SIZE": str(nproc), "WORKER_FORK": "1", "MASTER_ADDR": "127.0.0.1",
                "MASTER_PORT": str(_free_port()), "OMP_NUM_THREADS": "1", "GLOO_SOCKET_IFNAME": "lo",
                **{f"SFTCTL_{k.upper()}": str(v) for k, v in layout.items()}})
    proc = subprocess.run([sys.executable, str(WORKER), str(out), *args], env=env, capture_output=True, text=True,
                          timeout=deadline(240))
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-6000:]
    return json.loads(out.read_text())


def assert_matches(got: dict, steps: int = 20) -> None:
    losses, ref = got["losses"], got["ref_losses"]
    assert len(losses) == len(ref) == steps
    for i, (a, b) in enumerate(zip(losses, ref)):
        assert a == pytest.approx(b, rel=REL), (i, a, b, got["layout"])
    assert losses[-1] < 0.9 * losses[0]  # it trained


# share: the fraction of the model's parameter bytes each rank holds (its local shards). The tiny
# Llama (vocab 64, dim 32, 4 layers) is 45 344 float64 parameters, 40 960 of them in the
# q/k/v/o and w1/w3/w2 matrices TP halves; the MoE (2 layers, 4 experts) 61 856, 49 152 in experts.
@pytest.mark.parametrize("name,layout,args,share", [
    # fsdp: matrices / (tp 2 x dp 2), the rest / dp 2
    ("tp2_dp2", {"tp": 2, "dp": 2, "dp_sharding": "fsdp"}, (), (40960 / 4 + 4384 / 2) / 45344),
    # ddp: each stage's half (embeddings on the first, norm + output on the last: equal sizes), replicated
    ("pp2_dp2_1f1b", {"pp": 2, "dp": 2, "micro_batches": 2, "pp_schedule": "1f1b"}, (), 0.5),
    # interleaved 1F1B, 2 chunks per rank: rank 0 layers 0 and 2 + embeddings, rank 1 layers 1, 3 + norm, output
    ("pp2_v2_dp2_interleaved", {"pp": 2, "dp": 2, "micro_batches": 2, "pp_schedule": "interleaved",
                                "pp_interleave": 2}, (), 0.5),
    # ddp is HSDP on (dp, cp): replicated over dp, sharded over cp
    ("cp2_dp2", {"cp": 2, "dp": 2}, (), 0.5),
    # dense replicated over dp 4; this rank's 2 of 4 experts sharded over the 2 ranks holding them
    ("ep2_dp4_moe", {"ep": 2, "dp": 4}, ("--moe",), (61856 - 49152 + 49152 / 4) / 61856),
    # tp 2 halves the attention matrices (8192); experts stay whole over tp, this rank's 2 of 4 on it alone
    ("tp2_ep2_dp2_moe", {"tp": 2, "ep": 2, "dp": 2}, ("--moe",), (8192 / 2 + 4512 + 49152 / 2) / 61856),
    # half the layers, their matrices halved again
    ("tp2_pp2_1f1b", {"tp": 2, "pp": 2, "micro_batches": 2}, (), (40960 / 4 + 4384 / 2) / 45344),
])
def test_layout_trains_as_the_float64_reference(tmp_path, name, layout, args, share):
    got = launch(tmp_path / f"{name}.json", layout, *args)
    assert_matches(got)
    if "pp" in layout:
        assert got["schedule"] == ("ScheduleInterleaved1F1B" if layout.get("pp_interleave") else "Schedule1F1B")
    # each rank holds its share of parameters, as much of gradients, AdamW's two moments twice that
    full = got["model_bytes"]
    for held in got["rank_bytes"]:
        assert held["params"] / full == pytest.approx(share, abs=2e-3), (held, full)
        assert held["grads"] == held["params"]
        assert held["optim"] == 2 * held["params"]


@pytest.mark.parametrize("before,after,label", [
    # prepare() wraps the DP4 run in DDP: full tensors read from 2-D (tp, dp) DTensor shards
    ({"tp": 2, "dp": 2}, {"dp": 4}, "dp4 ddp"),
    # pipeline stages' shards (each stage saved its own layers) into tensor-parallel FSDP
    ({"pp": 2, "dp": 2, "micro_batches": 2}, {"tp": 2, "dp": 2, "dp_sharding": "fsdp"}, "tp2 dp2 fsdp"),
])
def test_checkpoint_resumes_on_another_layout(tmp_path, before, after, label):
    ckpt = tmp_path / "ckpt"
    first = launch(tmp_path / "a.json", before, "--steps", "10", "--save", str(ckpt))
    assert (ckpt / "step-00000010" / ".metadata").is_file()
    second = launch(tmp_path / "b.json", after, "--first", "10", "--steps", "10", "--load", str(ckpt))
    assert second["layout"] == label
    assert_matches({"losses": first["losses"] + second["losses"], "layout": f"{first['layout']} -> {label}",
                    "ref_losses": first["ref_losses"] + second["ref_losses"]})


def test_layouts_a_model_cannot_take_are_one_clear_error():
    torch = pytest.importorskip("torch")
    from sftctl.errors import SpecError
    from sftctl.train.mesh import Layout, layout
    from sftctl.train.parallel import check_splittable, prepare_layout
    from sftctl.train.pipeline import stage_layers, stage_module
    from sftctl.train.tiny import tiny_llama

    mlp = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Linear(8, 4))
    with pytest.raises(SpecError, match="no Linear named"):
        check_splittable(mlp, Layout(tp=2))
    with pytest.raises(SpecError, match="no MoE layer"):
        check_splittable(tiny_llama(), Layout(ep=2, dp=2))
    with pytest.raises(SpecError, match="has no tok_embeddings, layers, norm, output"):
        stage_module(mlp, 0, 2)
    with pytest.raises(SpecError, match="does not divide dp\\*cp"):
        Layout(ep=4, dp=2).check(2)
    with pytest.raises(SpecError, match="process group has 2 ranks"):
        Layout(tp=2, dp=2).check(2)
    assert [list(stage_layers(5, s, 2)) for s in range(2)] == [[0, 1, 2], [3, 4]]
    lay = layout({"SFTCTL_TP": "2", "SFTCTL_PP": "2", "SFTCTL_DP": "2", "SFTCTL_DP_SHARDING": "fsdp"})
    assert (lay.tp, lay.pp, lay.dp, lay.world, lay.label) == (2, 2, 2, 8, "tp2 pp2 dp2 fsdp")
    with pytest.raises(SpecError, match="pipeline stages are not applied by prepare") as exc:
        prepare_layout(tiny_llama(), Layout(pp=2, micro_batches=2))
    assert "build_pipeline" in exc.value.hint
    model = stage_module(tiny_llama(n_layers=4), 1, 2)
    assert list(model.layers.keys()) == ["2", "3"] and model.tok_embeddings is None and model.output is not None
