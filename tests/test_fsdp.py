"""Sharded training on this CPU (gloo): FSDP2 over 2 local processes through
sftctl.train.prepare, DCP checkpoints (every rank writes its shards; a torn one is skipped;
keep-K), and a resume on 1 process that reshards the checkpoint and keeps the global batch by
gradient accumulation. Reference: the same model trained in one process on the whole batch."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

REPO = Path(__file__).resolve().parents[1]
WORKER = REPO / "tests" / "shard_worker.py"
sys.path.insert(0, str(REPO / "tests"))
import shard_worker  # noqa: E402
from conftest import deadline  # noqa: E402


def launch(tmp_path: Path, nproc: int, out: Path, ckpt: Path, **env: str) -> subprocess.CompletedProcess:
    e = {k: v for k, v in os.environ.items() if not k.startswith(("SFTCTL_", "WORKER_"))}
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        e.pop(k, None)
    out.mkdir(parents=True, exist_ok=True)
    e.update(GLOO_SOCKET_IFNAME="lo", OMP_NUM_THREADS="1",
             PYTHONPATH=os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])),
             WORKER_OUT=str(out), SFTCTL_CHECKPOINT_DIR=str(ckpt), SFTCTL_CHECKPOINT_INTERVAL="2",
             SFTCTL_KEEP_CHECKPOINTS="2", SFTCTL_PARALLELISM="fsdp", SFTCTL_DTYPE="float32", **env)
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nnodes=1",
                           f"--nproc-per-node={nproc}", str(WORKER)],
                          cwd=tmp_path, env=e, capture_output=True, text=True, timeout=deadline(300))
    (out / "log.txt").write_text(proc.stdout + proc.stderr)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    return proc


def reference(steps: int) -> tuple[dict, dict]:
    """One process, no wrapper, float64, the whole global batch a step: losses and parameters."""
    model = shard_worker.build().double()
    opt = torch.optim.AdamW(model.parameters(), lr=shard_worker.LR)
    losses, params = {}, {}
    for step in range(1, steps + 1):
        x, y = shard_worker.global_batch(step)
        loss = shard_worker.next_byte_loss(model, (x, y))
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses[step] = loss.item()
        params[step] = {k: v.detach().clone() for k, v in model.state_dict().items()}
    return losses, params


def close(a: dict, b: dict, atol: float) -> float:
    assert a.keys() == b.keys()
    worst = max((a[k].double() - b[k].double()).abs().max().item() for k in a)
    assert worst <= atol, worst
    return worst


def test_fsdp_two_ranks_dcp_checkpoints_and_elastic_resume_on_one(tmp_path):
    steps = 6
    ref_losses, ref_params = reference(steps)
    # 1. uninterrupted: 2 ranks, FSDP, checkpoints at 2, 4, 6 (keep 2)
    full, ckpt = tmp_path / "full", tmp_path / "ckpt"
    storage_dir = tmp_path / "storage"  # the job's storage, a directory (as S3/GCS through the same layer)
    proc = launch(tmp_path, 2, full, ckpt, WORKER_STEPS=str(steps), SFTCTL_STORAGE_URL=str(storage_dir))
    assert "fsdp: 2 blocks + root sharded over 2 ranks" in proc.stderr
    assert json.loads((full / "strategy.json").read_text())["fsdp"] is True
    assert sorted(p.name for p in ckpt.iterdir()) == ["step-00000004", "step-00000006"]  # keep-K
    files = sorted(p.name for p in (ckpt / "step-00000006").iterdir())
    assert files == [".metadata", "COMPLETE", "__0_0.distcp", "__1_0.distcp", "extra.pt"]  # every rank its shard
    assert json.loads((ckpt / "step-00000006" / "COMPLETE").read_text()) == {"step": 6, "format": "dcp",
                                                                           "world_size": 2}
    from sftctl.storage import open_storage
    from sftctl.storage.checkpoints import complete_steps, read_manifest

    storage = open_storage(str(storage_dir))
    assert complete_steps(storage) == [4, 6]  # keep-K in storage too; manifests written last
    assert sorted(f.name for f in read_manifest(storage, 6).files) == [
        ".metadata", "__0_0.distcp", "__1_0.distcp", "extra.pt"]  # both ranks uploaded their shards
    losses = {int(k): v for k, v in json.loads((full / "losses.json").read_text()).items()}
    # float32 FSDP against the float64 single-process reference: same training, stated tolerance
    for s in range(1, steps + 1):
        assert losses[s] == pytest.approx(ref_losses[s], abs=2e-5), s
    close(torch.load(full / "params-6.pt"), ref_params[6], atol=2e-4)

    # 2. the node is lost after step 4: keep step 4, tear step 6 (shards, no .metadata, no COMPLETE)
    # and leave a dead writer's temporary directory; resume on ONE process
    lost = tmp_path / "lost"
    shutil.copytree(ckpt / "step-00000004", lost / "step-00000004")
    torn = lost / "step-00000006"
    torn.mkdir()
    shutil.copy(ckpt / "step-00000006" / "__0_0.distcp", torn)
    shutil.copytree(ckpt / "step-00000006", lost / "step-00000006.tmp-999999")
    (lost / "step-00000006.tmp-999999" / ".metadata").unlink()
    one = tmp_path / "one"
    launch(tmp_path, 1, one, lost, WORKER_STEPS=str(steps))
    resumed = json.loads((one / "resumed.json").read_text())
    assert resumed == {"step": 4, "world": 1, "accum": 4, "extra": {"data_step": 4}}  # the torn step 6 skipped
    # resharded 2 -> 1: exactly the parameters saved at step 4
    close(torch.load(one / "params-loaded.pt"), torch.load(full / "params-4.pt"), atol=0.0)
    # the same global batch by accumulation: the loss curve continues as the uninterrupted one
    one_losses = {int(k): v for k, v in json.loads((one / "losses.json").read_text()).items()}
    assert sorted(one_losses) == [5, 6]
    for s in (5, 6):
        assert one_losses[s] == pytest.approx(losses[s], abs=2e-5), s
    close(torch.load(one / "params-6.pt"), torch.load(full / "params-6.pt"), atol=2e-5)
    assert (lost / "step-00000006" / ".metadata").is_file()  # rewritten complete by the resumed run
    assert not (lost / "step-00000006.tmp-999999").exists()  # a dead writer's leftovers pruned


def test_strategy_comes_from_the_environment(monkeypatch):
    from sftctl import train as sft

    monkeypatch.delenv("SFTCTL_PARALLELISM", raising=False)
    monkeypatch.delenv("SFTCTL_ACTIVATION_CHECKPOINTING", raising=False)
    assert sft.strategy() == ("ddp", False)
    monkeypatch.setenv("SFTCTL_PARALLELISM", "FSDP")
    monkeypatch.setenv("SFTCTL_ACTIVATION_CHECKPOINTING", "1")
    assert sft.strategy() == ("fsdp", True)
    monkeypatch.setenv("SFTCTL_PARALLELISM", "zero2")
    with pytest.raises(ValueError, match="SFTCTL_PARALLELISM: expected ddp or fsdp, got 'zero2'"):
        sft.strategy()


def test_prepare_checkpoints_blocks_and_keeps_their_numbers(monkeypatch):
    """Activation checkpointing without a process group: same state-dict keys, same gradients
    (float64, fresh random input) as the plain model."""
    from sftctl import train as sft

    monkeypatch.delenv("SFTCTL_PARALLELISM", raising=False)
    plain = shard_worker.build().double()
    ck = sft.prepare(shard_worker.build().double(), activation_checkpointing=True, dtype="float32")
    assert list(ck.state_dict()) == list(plain.state_dict())
    x = torch.randint(0, 256, (3, 16))
    for m in (plain, ck):
        shard_worker.next_byte_loss(m, (x, x)).backward()
    for (n, a), (_, b) in zip(plain.named_parameters(), ck.named_parameters()):
        assert torch.allclose(a.grad, b.grad, rtol=1e-12, atol=1e-12), n
    assert sum("CheckpointWrapper" in type(b).__name__ for b in sft.blocks(ck)) == 2


def test_llama_example_trains_sharded_and_resumes(tmp_path):
    """examples/llama/train.py (transformers' LlamaForCausalLM, CPU shape) under FSDP on 2
    processes: its decoder layers are the FSDP units, its loss goes down, and a second run
    resumes from the sharded checkpoint."""
    pytest.importorskip("transformers")
    ckpt = tmp_path / "ckpt"
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SFTCTL_", "WORKER_"))}
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(k, None)
    env.update(GLOO_SOCKET_IFNAME="lo", OMP_NUM_THREADS="1",
               PYTHONPATH=os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])),
               SFTCTL_CHECKPOINT_DIR=str(ckpt), SFTCTL_PARALLELISM="fsdp", SFTCTL_TRAIN_STEPS="8",
               SFTCTL_CHECKPOINT_INTERVAL="4", SFTCTL_BATCH_SIZE="2")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
           str(REPO / "examples" / "llama" / "train.py")]
    first = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=deadline(300))
    out = first.stdout + first.stderr
    assert first.returncode == 0, out[-4000:]
    assert "fsdp: 2 blocks + root sharded over 2 ranks" in out
    losses = [float(x.split()[-1]) for x in first.stdout.splitlines() if x.startswith("step ")]
    assert len(losses) == 8 and losses[-1] < losses[0]
    assert {"__0_0.distcp", "__1_0.distcp", ".metadata"} <= {p.name for p in (ckpt / "step-00000008").iterdir()}
    env["SFTCTL_TRAIN_STEPS"] = "10"
    second = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=deadline(300))
    # no tolerance for torch's teardown: the script ends with sft.finish() (sftctl/train/finish.py
    # says why a rank used to abort at interpreter exit, 2 of 2 loaded full-suite runs)
    assert second.returncode == 0, (second.stdout + second.stderr)[-4000:]
    assert "terminate called" not in first.stderr + second.stderr
    assert "resumed from step 8" in second.stdout and "step 10/10" in second.stdout
    assert (ckpt / "step-00000010" / "COMPLETE").is_file()


def test_finish_runs_atexit_flushes_and_exits_with_its_code(tmp_path):
    """sft.finish() outside torchrun: the atexit handlers run and buffered output is flushed
    before the process ends with the given code (it skips interpreter finalization)."""
    script = ("import atexit, sys\n"
              "from sftctl import train as sft\n"
              "atexit.register(lambda: print('atexit ran', flush=True))\n"
              "sys.stdout.write('buffered ')\n"
              "sft.finish(3)\n"
              "print('not reached')\n")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}
    proc = subprocess.run([sys.executable, "-c", script], cwd=tmp_path, env=env, capture_output=True, text=True,
                          timeout=deadline(60))
    assert (proc.returncode, proc.stdout) == (3, "buffered atexit ran\n"), proc.stderr
    bad = subprocess.run([sys.executable, "-c", "from sftctl import train as sft; sft.finish(300)"], cwd=tmp_path,
                         env=env, capture_output=True, text=True, timeout=deadline(60))
    assert bad.returncode == 1 and "exit_code must be 0..255, got 300" in bad.stderr


def test_finish_ends_every_rank_of_a_gloo_group_with_0(tmp_path):
    """Two gloo ranks whose process group outlives destroy_process_group (a DeviceMesh holds it,
    as FSDP2's does) end through sft.finish() with 0 and every line they printed."""
    script = tmp_path / "end.py"
    script.write_text(
        "import torch, torch.distributed as dist\n"
        "from torch.distributed.device_mesh import init_device_mesh\n"
        "from sftctl import train as sft\n"
        "dist.init_process_group('gloo')\n"
        "mesh = init_device_mesh('cpu', (dist.get_world_size(),))\n"
        "for _ in range(20):\n"
        "    out = [torch.empty(256) for _ in range(2)]\n"
        "    dist.all_gather(out, torch.full((256,), float(dist.get_rank())))\n"
        "print(f'rank {dist.get_rank()} sum {float(sum(o.sum() for o in out)):.0f}')\n"
        "sft.finish()\n")
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SFTCTL_", "WORKER_"))}
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(k, None)
    env.update(GLOO_SOCKET_IFNAME="lo", OMP_NUM_THREADS="1",
               PYTHONPATH=os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])))
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
                           str(script)], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=deadline(120))
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    # the two ranks share torchrun's stdout: their lines may interleave mid-line
    assert sorted(re.findall(r"rank \d sum \d+", proc.stdout)) == ["rank 0 sum 256", "rank 1 sum 256"], proc.stdout
