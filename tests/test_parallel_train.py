"""Issue 38 item 3, on CPU with gloo: a tiny Llama trained 20 AdamW steps in float64 with TP2 x DP2,
PP2 x DP2 (1F1B, 2 micro-batches; and interleaved 1F1B, 2 chunks per rank), TP2 x PP2 and CP2 x DP2 (ring attention), and a tiny MoE with
EP2 (x DP4, and x TP2 x DP2), over 4 processes, reaches at every step the loss of the same model trained unsplit in one process
on the whole batch (tests/parallel_train_worker.py computes both). A DCP checkpoint written under
TP2 x DP2 after 10 steps resumes under DP4 (and one written under PP2 x DP2 under TP2 x DP2, and under
PP2 x DP1 on the 2 ranks an elastic resume has left after a pipeline stage's node was lost), and the
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
    ({"tp": 2, "dp": 2}, {"dp": 4}, "dp4"),
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


def test_pipeline_stage_lost_resumes_on_fewer_ranks(tmp_path):
    """Issue 38 item 4: a PP2 x DP2 job loses a node holding a pipeline stage's ranks and no
    replacement comes: the elastic resume relaunches on the 2 ranks left with the plan's layout
    still exported (SFTCTL_PP=2, SFTCTL_DP=2: the controller's launch_env) and torchrun's
    WORLD_SIZE=2; sftctl.train.mesh.layout() resizes it to PP2 x DP1 (each stage on one rank, the
    whole batch per step), loads the last DCP checkpoint and the next 10 steps are the float64
    reference's steps 11-20."""
    ckpt = tmp_path / "ckpt"
    planned = {"pp": 2, "dp": 2, "micro_batches": 2}
    first = launch(tmp_path / "a.json", planned, "--steps", "10", "--save", str(ckpt))
    assert first["layout"] == "pp2 dp2"
    second = launch(tmp_path / "b.json", planned, "--first", "10", "--steps", "10", "--load", str(ckpt), nproc=2)
    assert second["layout"] == "pp2 dp1" and second["schedule"] == "Schedule1F1B"
    # each of the 2 ranks now holds a whole stage: half the model
    assert [held["params"] / second["model_bytes"] for held in second["rank_bytes"]] == \
        pytest.approx([0.5, 0.5], abs=2e-3)
    assert_matches({"losses": first["losses"] + second["losses"], "layout": "pp2 dp2 -> pp2 dp1",
                    "ref_losses": first["ref_losses"] + second["ref_losses"]})


def test_layout_resizes_to_the_ranks_left():
    """The layout an elastic resume runs (sftctl.types.layout.Layout.resized) and exports
    (launch_env with the ranks left): the data degree absorbs the loss, then the pipeline degree;
    the global batch stays; a tensor degree the ranks cannot hold is one clear error."""
    from sftctl.compiler.layouts.offering import launch_env, layout_doc
    from sftctl.errors import SpecError
    from sftctl.train.mesh import layout
    from sftctl.types import Layout

    lay = Layout(pp=2, dp=2, micro_batch=2, micro_batches=4, dp_sharding="fsdp")
    small = lay.resized(2)
    assert (small.pp, small.dp, small.micro_batch, small.global_batch, small.label) == (2, 1, 4, 16, "pp2 dp1")
    assert lay.resized(4) is lay
    assert Layout(tp=2, pp=4, dp=2, micro_batches=4).resized(8).label == "tp2 pp4 dp1"
    # 6 ranks: tp2 x pp4 no longer divides them; the stages merge to pp1, dp 3
    assert Layout(tp=2, pp=4, dp=2, micro_batches=4).resized(6).label == "tp2 dp3"
    assert Layout(ep=4, dp=4).resized(2).ep == 2  # ep borrows data ranks: at most dp
    with pytest.raises(SpecError, match="cannot hold its tensor degree tp4"):
        Layout(tp=4, dp=2).resized(2)
    env = launch_env(layout_doc(lay, "search"), world=2)
    assert (env["SFTCTL_PP"], env["SFTCTL_DP"], env["SFTCTL_MICRO_BATCHES"]) == ("2", "1", "4")
    assert launch_env(layout_doc(lay, "search"))["SFTCTL_DP"] == "2"
    # torchrun's WORLD_SIZE below the exported layout's ranks: training resizes it the same way
    got = layout({"SFTCTL_PP": "2", "SFTCTL_DP": "2", "SFTCTL_MICRO_BATCHES": "2", "WORLD_SIZE": "2"})
    assert (got.pp, got.dp, got.label) == (2, 1, "pp2 dp1")
    # the plan's document reads back as the record (an older document's key names too)
    assert Layout.from_dict(layout_doc(lay, "search")) == lay
    assert Layout.from_dict({"dp": 4, "sharding": "fsdp", "activation_checkpointing": True}) == \
        Layout(dp=4, dp_sharding="fsdp", checkpointing=True)


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
    with pytest.raises(SpecError, match="without loss_fn") as exc:
        prepare_layout(tiny_llama(), Layout(pp=2, micro_batches=2))
    assert "sft.prepare(model, loss_fn=loss_fn)" in exc.value.hint and "train.pipeline" in exc.value.hint
    model = stage_module(tiny_llama(n_layers=4), 1, 2)
    assert list(model.layers.keys()) == ["2", "3"] and model.tok_embeddings is None and model.output is not None


def test_sharded_checkpoint_keys_optimizer_state_by_name_and_reads_the_old_form(tmp_path, monkeypatch):
    """save_sharded_checkpoint keys AdamW's state and param groups by parameter name (so pipeline
    stages' groups reshard onto other stages, as the lost-stage resume above needs); a checkpoint
    of the list-indexed form written before still loads, every tensor as it was saved. One process."""
    torch = pytest.importorskip("torch")
    import json as _json
    import shutil

    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    from sftctl.train import load_sharded_checkpoint, save_sharded_checkpoint
    from sftctl.train.tiny import tiny_llama

    monkeypatch.setenv("SFTCTL_CHECKPOINT_DIR", str(tmp_path))
    monkeypatch.delenv("SFTCTL_STORAGE_URL", raising=False)
    model = tiny_llama(seed=0)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    tokens = torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(1))
    model(tokens).sum().backward()
    opt.step()
    save_sharded_checkpoint(model, opt, 5)
    keys = dcp.FileSystemReader(str(tmp_path / "step-00000005")).read_metadata().state_dict_metadata
    assert "optim.state.tok_embeddings.weight.exp_avg" in keys and "optim.param_groups.tok_embeddings.weight.lr" in keys
    # the old form: list-indexed groups ("optim.param_groups.0.lr"), written as sftctl did before
    old = tmp_path / "step-00000007"
    shutil.copytree(tmp_path / "step-00000005", old)
    for f in old.glob("*.distcp"):
        f.unlink()
    (old / ".metadata").unlink()
    model_sd, optim_sd = get_state_dict(model, opt)
    dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=str(old))
    (old / "COMPLETE").write_text(_json.dumps({"step": 7, "format": "dcp", "world_size": 1}))
    assert "optim.param_groups.0.lr" in dcp.FileSystemReader(str(old)).read_metadata().state_dict_metadata
    fresh = tiny_llama(seed=3)
    fresh_opt = torch.optim.AdamW(fresh.parameters(), lr=1e-2)
    got = load_sharded_checkpoint(fresh, fresh_opt)
    assert got is not None and got[0] == 7
    for (name, a), b in zip(model.named_parameters(), fresh.parameters()):
        assert torch.equal(a, b), name
        assert torch.equal(opt.state[a]["exp_avg_sq"], fresh_opt.state[b]["exp_avg_sq"]), name


@pytest.mark.parametrize("cp", [2, 4])
def test_ring_attention_splits_causal_work_evenly_and_matches_whole_attention(tmp_path, cp):
    """Context parallelism's default split is the zigzag one (rank i holds chunks i and 2cp-1-i of
    2cp): each rank's forward attention FLOPs (torch's FlopCounterMode, measured) are equal, and
    its outputs and q/k/v gradients equal whole-sequence float64 SDPA's (1e-12: only the order of
    sums differs). The contiguous split, kept as an option, gives the last rank (2cp-1)/cp times
    the mean's score blocks (cp 2: 2 blocks against 1; cp 4: 7 against 1), which the layout price
    charges a contiguous run (sftctl.compiler.layouts.price's ``cp_load_balance``)."""
    from sftctl.train.context_parallel import attention_work

    out = tmp_path / "ring.json"
    env = {k: v for k, v in os.environ.items() if not k.startswith("SFTCTL_")}
    env.update({"WORLD_SIZE": str(cp), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(_free_port()),
                "OMP_NUM_THREADS": "1", "GLOO_SOCKET_IFNAME": "lo"})
    proc = subprocess.run([sys.executable, str(HERE / "ring_attention_worker.py"), str(out)], env=env,
                          capture_output=True, text=True, timeout=deadline(240))
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-6000:]
    ranks = json.loads(out.read_text())
    for r in ranks:
        for split in ("default", "contiguous"):
            assert max(r[split]["errors"]) < 1e-12, (split, r)
    balanced = [r["default"]["flops"] for r in ranks]
    assert len(set(balanced)) == 1 and balanced[0] > 0, balanced
    contiguous = [r["contiguous"]["flops"] for r in ranks]
    # each computed block is c x c scores (c = 32 / cp): QK^T and PV, 2 c^2 d flops each per head
    # (d = 8, 2 heads); rank r computes r + 1 blocks
    block = 2 * 2 * 2 * (32 // cp) ** 2 * 8
    assert contiguous == [(r + 1) * block for r in range(cp)]
    # zigzag: 2cp chunks of c' = 32 / 2cp; a rank's 2 chunks see 2cp + 1 blocks of c' x c' between them
    assert balanced[0] == (2 * cp + 1) * 2 * 2 * 2 * (32 // (2 * cp)) ** 2 * 8
    assert max(contiguous) > balanced[0]
    # the count of unmasked pairs: equal per rank zigzagged; contiguous the last (2cp-1)/cp x the mean
    work = attention_work(32, cp)
    assert len(set(work)) == 1 and sum(work) == 32 * 33 // 2
    slow = attention_work(32, cp, load_balance=False)
    assert max(slow) / (sum(slow) / cp) == pytest.approx((2 * cp - 1) / cp, rel=0.1)
