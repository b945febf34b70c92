"""Tests for sftctl/train.py: metrics reporting, atomic checkpoints, job configuration."""

from __future__ import annotations

import dataclasses
import json
import math
import os
import random
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

from sftctl import train as sft  # noqa: E402

REPO_ROOT = Path(__file__).resolve().parents[1]
ENV_VARS = (
    "SFTCTL_METRICS_DIR",
    "SFTCTL_CHECKPOINT_DIR",
    "SFTCTL_KEEP_CHECKPOINTS",
    "RANK",
    "SFTCTL_NODE_RANK",
    "SFTCTL_NUM_NODES",
    "SFTCTL_TRAIN_STEPS",
    "SFTCTL_BATCH_SIZE",
    "SFTCTL_CHECKPOINT_INTERVAL",
    "SFTCTL_DTYPE",
    "SFTCTL_JOB_ID",
)


@pytest.fixture(autouse=True)
def clean_env(monkeypatch, tmp_path):
    for name in ENV_VARS:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.chdir(tmp_path)


@pytest.fixture
def ckpt_dir(monkeypatch, tmp_path) -> Path:
    path = tmp_path / "ckpt"
    monkeypatch.setenv("SFTCTL_CHECKPOINT_DIR", str(path))
    return path


def child_env() -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO_ROOT), env.get("PYTHONPATH")]))
    return env


def read_jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


# ---------------------------------------------------------------------------------------------
# import weight
# ---------------------------------------------------------------------------------------------


def test_import_does_not_import_torch():
    code = "import sys, sftctl.train; print('torch' in sys.modules)"
    out = subprocess.run(
        [sys.executable, "-c", code], env=child_env(), capture_output=True, text=True, check=True
    )
    assert out.stdout.strip() == "False"


# ---------------------------------------------------------------------------------------------
# report
# ---------------------------------------------------------------------------------------------


def test_report_writes_one_json_line_per_call_per_rank(monkeypatch, tmp_path):
    metrics = tmp_path / "does" / "not" / "exist"
    monkeypatch.setenv("SFTCTL_METRICS_DIR", str(metrics))
    before = time.time()
    monkeypatch.setenv("RANK", "1")
    sft.report(1, 2.5, step_time_s=0.25, tokens_per_s=1024.0)
    sft.report(2, 2.25)
    monkeypatch.setenv("RANK", "0")
    sft.report(1, 3.5, step_time_s=0.5, tokens_per_s=512.0)
    after = time.time()

    assert sorted(p.name for p in metrics.iterdir()) == ["rank-0.jsonl", "rank-1.jsonl"]
    r1 = read_jsonl(metrics / "rank-1.jsonl")
    assert len(r1) == 2
    assert {k: v for k, v in r1[0].items() if k != "ts"} == {
        "rank": 1, "step": 1, "loss": 2.5, "step_time_s": 0.25, "tokens_per_s": 1024.0,
    }
    assert {k: v for k, v in r1[1].items() if k != "ts"} == {
        "rank": 1, "step": 2, "loss": 2.25, "step_time_s": None, "tokens_per_s": None,
    }
    assert before <= r1[0]["ts"] <= r1[1]["ts"] <= after
    r0 = read_jsonl(metrics / "rank-0.jsonl")
    assert [(r["rank"], r["step"], r["loss"]) for r in r0] == [(0, 1, 3.5)]
    # Whole lines only.
    assert (metrics / "rank-1.jsonl").read_text().endswith("}\n")


def test_report_rank_falls_back_to_node_rank_then_zero(monkeypatch, tmp_path):
    monkeypatch.setenv("SFTCTL_METRICS_DIR", str(tmp_path / "m"))
    monkeypatch.setenv("SFTCTL_NODE_RANK", "3")
    sft.report(5, 1.0)
    monkeypatch.setenv("RANK", "2")  # RANK wins over SFTCTL_NODE_RANK
    sft.report(6, 1.0)
    monkeypatch.delenv("RANK")
    monkeypatch.delenv("SFTCTL_NODE_RANK")
    sft.report(7, 1.0)
    assert [r["step"] for r in read_jsonl(tmp_path / "m" / "rank-3.jsonl")] == [5]
    assert [r["step"] for r in read_jsonl(tmp_path / "m" / "rank-2.jsonl")] == [6]
    assert [(r["rank"], r["step"]) for r in read_jsonl(tmp_path / "m" / "rank-0.jsonl")] == [(0, 7)]


def test_report_nonfinite_loss_is_valid_json_null(monkeypatch, tmp_path):
    """A diverged loss (NaN, inf) is a fact worth reporting: it is written as null (the state
    and JSON have no NaN), and the step is kept."""
    monkeypatch.setenv("SFTCTL_METRICS_DIR", str(tmp_path))
    sft.report(1, float("nan"), step_time_s=0.5)
    sft.report(2, float("-inf"))
    recs = read_jsonl(tmp_path / "rank-0.jsonl")  # json.loads would accept NaN; check text too
    assert [(r["step"], r["loss"], r["step_time_s"]) for r in recs] == [(1, None, 0.5), (2, None, None)]
    assert "NaN" not in (tmp_path / "rank-0.jsonl").read_text()


@pytest.mark.parametrize("args, kw, message", [
    ((2**63, 1.0), {}, r"step: 9223372036854775808 is not an integer in \[0, 2\*\*63\)"),
    ((-5, 1.0), {}, r"step: -5 is not an integer in \[0, 2\*\*63\)"),
    ((1.5, 1.0), {}, r"step: 1.5 is not an integer"),
    ((True, 1.0), {}, r"step: True is not an integer"),
    (("7", 1.0), {}, r"step: '7' is not an integer"),
    ((1, "low"), {}, r"loss: 'low' is not a number"),
    ((1, 1.0), {"step_time_s": -1}, r"step_time_s: -1 is not a finite number >= 0"),
    ((1, 1.0), {"step_time_s": float("nan")}, r"step_time_s: nan is not a finite number >= 0"),
    ((1, 1.0), {"step_time_s": float("inf")}, r"step_time_s: inf is not a finite number >= 0"),
    ((1, 1.0), {"tokens_per_s": -3.0}, r"tokens_per_s: -3.0 is not a finite number >= 0"),
    ((1, 1.0), {"compute_time_s": float("inf")}, r"compute_time_s: inf is not a finite number >= 0"),
    ((1, 1.0), {"lr": float("nan")}, r"lr: nan is not a finite number"),
])
def test_report_refuses_a_bad_step_or_number_naming_the_argument(monkeypatch, tmp_path, args, kw, message):
    """Nothing is written for a refused report: the controller would have dropped it."""
    monkeypatch.setenv("SFTCTL_METRICS_DIR", str(tmp_path))
    with pytest.raises(ValueError, match=message):
        sft.report(*args, **kw)
    assert not (tmp_path / "rank-0.jsonl").exists()


def test_report_takes_numpy_and_tensor_scalars(monkeypatch, tmp_path):
    import numpy as np

    monkeypatch.setenv("SFTCTL_METRICS_DIR", str(tmp_path))
    sft.report(np.int64(3), torch.tensor(0.5), step_time_s=np.float32(0.25), tokens_per_s=0)
    sft.report(torch.tensor(4), np.float64(0.75))
    recs = read_jsonl(tmp_path / "rank-0.jsonl")
    assert [(r["step"], r["loss"], r["step_time_s"], r["tokens_per_s"]) for r in recs] == [
        (3, 0.5, 0.25, 0.0), (4, 0.75, None, None)]


def test_report_is_noop_without_metrics_dir(tmp_path):
    sft.report(1, 1.0, step_time_s=0.1, tokens_per_s=10.0)
    assert list(tmp_path.iterdir()) == []


def test_report_rejects_malformed_rank(monkeypatch, tmp_path):
    monkeypatch.setenv("SFTCTL_METRICS_DIR", str(tmp_path))
    monkeypatch.setenv("RANK", "one")
    with pytest.raises(ValueError, match="RANK"):
        sft.report(1, 1.0)


# ---------------------------------------------------------------------------------------------
# checkpoints
# ---------------------------------------------------------------------------------------------


def test_checkpoint_dir_default_and_env(monkeypatch, tmp_path):
    assert sft.checkpoint_dir() == Path("checkpoints")
    monkeypatch.setenv("SFTCTL_CHECKPOINT_DIR", str(tmp_path / "x"))
    assert sft.checkpoint_dir() == tmp_path / "x"


def test_no_checkpoint_returns_none(ckpt_dir):
    assert sft.latest_checkpoint() is None
    assert sft.load_latest_checkpoint() is None
    ckpt_dir.mkdir()
    assert sft.latest_checkpoint() is None


def test_save_load_round_trip(ckpt_dir):
    gen = torch.Generator().manual_seed(random.randrange(2**31))
    state = {
        "model": {"w": torch.randn(17, 5, generator=gen), "b": torch.randn(5, generator=gen)},
        "ids": torch.randint(0, 1000, (33,), generator=gen),
        "half": torch.randn(4, generator=gen).to(torch.bfloat16),
        "lr": 0.125,
        "step": 7,
    }
    path = sft.save_checkpoint(state, 7)
    assert path == ckpt_dir / "step-00000007"
    assert sorted(p.name for p in path.iterdir()) == ["COMPLETE", "state.pt"]
    assert json.loads((path / "COMPLETE").read_text()) == {"step": 7}
    assert sft.latest_checkpoint() == path

    step, loaded = sft.load_latest_checkpoint()
    assert step == 7
    assert set(loaded) == set(state)
    assert torch.equal(loaded["model"]["w"], state["model"]["w"])
    assert torch.equal(loaded["model"]["b"], state["model"]["b"])
    assert torch.equal(loaded["ids"], state["ids"]) and loaded["ids"].dtype == torch.int64
    assert torch.equal(loaded["half"], state["half"]) and loaded["half"].dtype == torch.bfloat16
    assert loaded["lr"] == 0.125 and loaded["step"] == 7
    # Nothing else left in the directory (no tmp dirs).
    assert [p.name for p in ckpt_dir.iterdir()] == ["step-00000007"]


def test_keep_deletes_older_checkpoints(ckpt_dir):
    for step in (10, 20, 30, 40, 50):
        sft.save_checkpoint({"v": torch.tensor([float(step)])}, step, keep=2)
    assert sorted(p.name for p in ckpt_dir.iterdir()) == ["step-00000040", "step-00000050"]
    step, state = sft.load_latest_checkpoint()
    assert step == 50 and state["v"].item() == 50.0
    sft.save_checkpoint({"v": torch.tensor([60.0])}, 60)  # default keep=3
    assert sorted(p.name for p in ckpt_dir.iterdir()) == [
        "step-00000040", "step-00000050", "step-00000060",
    ]


def test_keep_defaults_to_the_specs_keep_checkpoints(ckpt_dir, monkeypatch):
    """Issue 14.6: the controller exports train.keep_checkpoints; save_checkpoint honours it."""
    monkeypatch.setenv("SFTCTL_KEEP_CHECKPOINTS", "1")
    for step in (10, 20, 30):
        sft.save_checkpoint({"v": torch.tensor([float(step)])}, step)
    assert sorted(p.name for p in ckpt_dir.iterdir()) == ["step-00000030"]
    sft.save_checkpoint({"v": torch.tensor([40.0])}, 40, keep=2)  # an explicit keep wins
    assert sorted(p.name for p in ckpt_dir.iterdir()) == ["step-00000030", "step-00000040"]
    monkeypatch.setenv("SFTCTL_KEEP_CHECKPOINTS", "zero")
    with pytest.raises(ValueError, match="SFTCTL_KEEP_CHECKPOINTS: expected an integer"):
        sft.save_checkpoint({"v": torch.tensor([50.0])}, 50)


def test_latest_is_by_step_number_not_name_or_mtime(ckpt_dir):
    sft.save_checkpoint({"v": torch.tensor([9.0])}, 9)
    sft.save_checkpoint({"v": torch.tensor([100_000_000.0])}, 100_000_000)  # 9 digits
    sft.save_checkpoint({"v": torch.tensor([50.0])}, 50)  # written last
    assert sft.latest_checkpoint() == ckpt_dir / "step-100000000"


def test_save_rejects_bad_arguments(ckpt_dir):
    with pytest.raises(ValueError, match="keep"):
        sft.save_checkpoint({}, 1, keep=0)
    with pytest.raises(ValueError, match="step"):
        sft.save_checkpoint({}, -1)


def test_resave_same_step_replaces_it(ckpt_dir):
    sft.save_checkpoint({"v": torch.tensor([1.0])}, 5)
    sft.save_checkpoint({"v": torch.tensor([2.0])}, 5)
    assert [p.name for p in ckpt_dir.iterdir()] == ["step-00000005"]
    step, state = sft.load_latest_checkpoint()
    assert step == 5 and state["v"].item() == 2.0


def test_half_written_checkpoints_are_never_picked(ckpt_dir):
    good = {"v": torch.randn(8)}
    sft.save_checkpoint(good, 10)
    payload = ckpt_dir / "step-00000010" / "state.pt"

    # A tmp dir with everything in it (its writer not done renaming): ignored.
    tmp = ckpt_dir / f"step-00000020.tmp-{os.getppid()}"
    tmp.mkdir()
    (tmp / "state.pt").write_bytes(payload.read_bytes())
    (tmp / "COMPLETE").write_text('{"step": 20}')
    # Final name, state.pt but no COMPLETE marker.
    (ckpt_dir / "step-00000030").mkdir()
    (ckpt_dir / "step-00000030" / "state.pt").write_bytes(payload.read_bytes()[:100])
    # Final name, COMPLETE but no state.pt.
    (ckpt_dir / "step-00000040").mkdir()
    (ckpt_dir / "step-00000040" / "COMPLETE").write_text('{"step": 40}')
    # Final name, truncated COMPLETE.
    (ckpt_dir / "step-00000050").mkdir()
    (ckpt_dir / "step-00000050" / "state.pt").write_bytes(payload.read_bytes())
    (ckpt_dir / "step-00000050" / "COMPLETE").write_text('{"st')
    # A file, not a directory, with a checkpoint name.
    (ckpt_dir / "step-00000060").write_text("junk")

    assert sft.latest_checkpoint() == ckpt_dir / "step-00000010"
    step, state = sft.load_latest_checkpoint()
    assert step == 10 and torch.equal(state["v"], good["v"])


def test_stale_tmp_dirs_of_dead_processes_are_removed(ckpt_dir):
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    ckpt_dir.mkdir()
    stale = ckpt_dir / f"step-00000003.tmp-{dead.pid}"
    stale_old = ckpt_dir / f"step-00000003.tmp-{dead.pid}.old"
    live = ckpt_dir / f"step-00000004.tmp-{os.getppid()}"  # our parent is alive: kept
    for d in (stale, stale_old, live):
        d.mkdir()
        (d / "state.pt").write_bytes(b"partial")
    sft.save_checkpoint({"v": torch.zeros(1)}, 5)
    assert sorted(p.name for p in ckpt_dir.iterdir()) == [live.name, "step-00000005"]


KILLED_WRITER = textwrap.dedent(
    """
    import io, sys, time
    import torch
    from sftctl import train as sft

    seed, mode = int(sys.argv[1]), sys.argv[2]
    gen = torch.Generator().manual_seed(seed)
    sft.save_checkpoint({"v": torch.randn(1000, generator=gen)}, 1)
    print("SAVED 1", flush=True)

    if mode == "stall":
        # Deterministic: write the first half of a big checkpoint's bytes, then hang until killed.
        real_save = torch.save
        def stalled_save(obj, f, *args, **kwargs):
            buf = io.BytesIO()
            real_save(obj, buf, *args, **kwargs)
            data = buf.getvalue()
            f.write(data[: len(data) // 2])
            f.flush()
            print("STALLED", len(data), flush=True)
            time.sleep(3600)
        torch.save = stalled_save
        sft.save_checkpoint({"v": torch.randn(8 * 1024 * 1024, generator=gen)}, 2)
    else:
        # Killed at an arbitrary moment while writing big checkpoints over and over.
        step = 2
        while True:
            sft.save_checkpoint({"v": torch.full((16 * 1024 * 1024,), float(step))}, step, keep=2)
            print("SAVED", step, flush=True)
            step += 1
    """
)


def _start_writer(tmp_path: Path, ckpt_dir: Path, seed: int, mode: str) -> subprocess.Popen:
    script = tmp_path / "writer.py"
    script.write_text(KILLED_WRITER)
    env = child_env()
    env["SFTCTL_CHECKPOINT_DIR"] = str(ckpt_dir)
    return subprocess.Popen(
        [sys.executable, str(script), str(seed), mode],
        env=env,
        stdout=subprocess.PIPE,
        text=True,
    )


def _kill(proc: subprocess.Popen) -> None:
    proc.send_signal(signal.SIGKILL)
    proc.wait(timeout=30)
    assert proc.returncode == -signal.SIGKILL


def test_writer_killed_mid_write_leaves_previous_checkpoint_latest(ckpt_dir, tmp_path):
    seed = random.randrange(2**31)
    proc = _start_writer(tmp_path, ckpt_dir, seed, "stall")
    try:
        assert proc.stdout.readline().strip() == "SAVED 1"
        assert proc.stdout.readline().startswith("STALLED")
        tmp = ckpt_dir / f"step-00000002.tmp-{proc.pid}"
        assert (tmp / "state.pt").stat().st_size > 16 * 1024 * 1024  # half of a 32 MiB tensor
    finally:
        _kill(proc)

    assert tmp.exists()  # the torn write is still on disk...
    assert sft.latest_checkpoint() == ckpt_dir / "step-00000001"  # ...but never picked
    step, state = sft.load_latest_checkpoint()
    expected = torch.randn(1000, generator=torch.Generator().manual_seed(seed))
    assert step == 1 and torch.equal(state["v"], expected)

    # The next save cleans up the dead writer's tmp dir.
    sft.save_checkpoint({"v": torch.zeros(1)}, 3)
    assert sorted(p.name for p in ckpt_dir.iterdir()) == ["step-00000001", "step-00000003"]


def test_writer_killed_at_arbitrary_moment_leaves_a_loadable_checkpoint(ckpt_dir, tmp_path):
    proc = _start_writer(tmp_path, ckpt_dir, 0, "loop")
    try:
        assert proc.stdout.readline().strip() == "SAVED 1"
        time.sleep(random.uniform(0.2, 1.0))
    finally:
        _kill(proc)
    saved = [int(line.split()[1]) for line in proc.stdout.read().splitlines()]

    step, state = sft.load_latest_checkpoint()
    # The newest checkpoint whose save returned is at least as new as what the writer reported.
    assert step >= (saved[-1] if saved else 1)
    assert step <= (saved[-1] if saved else 1) + 1
    if step == 1:
        assert state["v"].numel() == 1000
    else:
        v = state["v"]
        assert v.numel() == 16 * 1024 * 1024
        assert bool((v == float(step)).all())


# ---------------------------------------------------------------------------------------------
# config
# ---------------------------------------------------------------------------------------------


def test_config_defaults():
    cfg = sft.config()
    assert cfg == sft.TrainConfig(
        steps=200, batch_size=16, checkpoint_interval=50, dtype="float32",
        job_id=None, node_rank=0, num_nodes=1,
    )
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.steps = 1  # type: ignore[misc]


def test_config_caller_defaults_and_env_overrides(monkeypatch):
    cfg = sft.config(steps=300, batch_size=8, checkpoint_interval=25, dtype="bf16")
    assert (cfg.steps, cfg.batch_size, cfg.checkpoint_interval, cfg.dtype) == (300, 8, 25, "bfloat16")

    for name, value in {
        "SFTCTL_TRAIN_STEPS": "20",
        "SFTCTL_BATCH_SIZE": "4",
        "SFTCTL_CHECKPOINT_INTERVAL": "10",
        "SFTCTL_DTYPE": "float16",
        "SFTCTL_JOB_ID": "job-42",
        "SFTCTL_NODE_RANK": "1",
        "SFTCTL_NUM_NODES": "2",
    }.items():
        monkeypatch.setenv(name, value)
    cfg = sft.config(steps=300, batch_size=8)
    assert cfg == sft.TrainConfig(
        steps=20, batch_size=4, checkpoint_interval=10, dtype="float16",
        job_id="job-42", node_rank=1, num_nodes=2,
    )


@pytest.mark.parametrize(
    "name, value, match",
    [
        ("SFTCTL_TRAIN_STEPS", "ten", "SFTCTL_TRAIN_STEPS"),
        ("SFTCTL_TRAIN_STEPS", "0", "SFTCTL_TRAIN_STEPS"),
        ("SFTCTL_BATCH_SIZE", "-3", "SFTCTL_BATCH_SIZE"),
        ("SFTCTL_CHECKPOINT_INTERVAL", "1.5", "SFTCTL_CHECKPOINT_INTERVAL"),
        ("SFTCTL_DTYPE", "int8", "SFTCTL_DTYPE"),
        ("SFTCTL_NODE_RANK", "1", "SFTCTL_NODE_RANK"),  # with 1 node
        ("SFTCTL_NUM_NODES", "0", "SFTCTL_NUM_NODES"),
    ],
)
def test_config_rejects_malformed_values(monkeypatch, name, value, match):
    monkeypatch.setenv(name, value)
    with pytest.raises(ValueError, match=match):
        sft.config()


def test_losses_in_metrics_are_floats(monkeypatch, tmp_path):
    # report() accepts a 0-d tensor's .item() and numpy-like floats alike.
    monkeypatch.setenv("SFTCTL_METRICS_DIR", str(tmp_path))
    sft.report(1, torch.tensor(1.5).item())
    (rec,) = read_jsonl(tmp_path / "rank-0.jsonl")
    assert isinstance(rec["loss"], float) and math.isclose(rec["loss"], 1.5)
