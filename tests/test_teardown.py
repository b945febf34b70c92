"""A node that fails in torch's teardown after the work is done and saved (a gloo/NCCL error in
sft.finish()'s barrier or destroy) ends the job SUCCEEDED with a `teardown_exit` warning event,
not FAILED; sft.finish() turns that error into one line and an exit code, not a traceback."""

from __future__ import annotations

import json

import pytest

from conftest import job_processes, sftctl, write_spec

pytest.importorskip("torch")

#: Two ranks of one node train 4 steps and save checkpoints; rank 1 then leaves without
#: sft.finish() (a peer gone), so rank 0's finish() barrier meets a closed gloo connection: the
#: real error a teardown raises after the last checkpoint ("Connection closed by peer").
TRAIN = """\
import os, time
import torch, torch.distributed as dist
from sftctl import train as sft
dist.init_process_group("gloo")
rank = dist.get_rank()
last = int(os.environ["LAST_CHECKPOINT"])
for step in range(1, 5):
    dist.all_reduce(torch.ones(4))
    sft.report(step, 1.0 / step)
    if rank == 0 and step <= last:
        sft.save_checkpoint({"step": step}, step)
dist.barrier()
if rank == 1:
    print("rank 1 leaves without finish()", flush=True)
    os._exit(0)
time.sleep(2)  # rank 1 is gone
sft.finish()
"""


@pytest.mark.parametrize("final_checkpoint", [True, False])
def test_a_teardown_error_after_the_final_checkpoint_is_not_a_failed_job(tmp_path, home, final_checkpoint):
    work = tmp_path / "work"
    work.mkdir()
    (work / "train.py").write_text(TRAIN)
    spec = write_spec(tmp_path / "job.yaml", f"""\
name: teardown-error
workdir: {work}
train: {{steps: 4}}
resources: {{accelerators: ["cpu:2"], nodes: 1}}
recovery: {{max_restarts: 0}}
env: {{OMP_NUM_THREADS: 1, LAST_CHECKPOINT: {4 if final_checkpoint else 3}}}
run: torchrun --nproc-per-node=2 train.py
""")
    proc = sftctl("run", str(spec), "--json")
    doc = json.loads(proc.stdout)
    events = json.loads(sftctl("events", doc["id"], "--json", check=True).stdout)["events"]
    teardown = [e for e in events if e["kind"] == "teardown_exit"]
    logs = sftctl("logs", doc["id"], check=True).stdout
    # finish() said what failed in one line, with no traceback of its own
    (said,) = [ln for ln in logs.splitlines() if "sftctl.train.finish:" in ln]
    assert "process group teardown failed after training: RuntimeError" in said and "Connection closed" in said
    assert "finish.py" not in logs and 'train.py", line' not in logs  # no traceback of the script's
    if final_checkpoint:
        assert (proc.returncode, doc["status"]) == (0, "SUCCEEDED"), logs[-3000:]
        assert len(teardown) == 1, events
        assert "node 0 exited with code 1" in teardown[0]["message"]
        assert "final checkpoint (step 4)" in teardown[0]["message"] and teardown[0]["data"]["step"] == 4
        assert teardown[0]["data"]["exit_code"] == 1
    else:  # the work was not all saved: a failure as before
        assert (proc.returncode, doc["status"]) == (1, "FAILED"), logs[-3000:]
        assert teardown == [] and "exited with code 1" in doc["failure_reason"]
    assert job_processes(doc["id"]) == []


def test_an_exception_raised_after_the_final_checkpoint_is_not_a_failed_job(tmp_path, home):
    """A script that trained every step, saved the final checkpoint, then raised (a NCCL or
    gloo destroy error outside sft.finish(); sftctl.train's excepthook records it: code
    `exception`) was FAILED; it is SUCCEEDED with a `teardown_exit` event naming the error."""
    spec = write_spec(tmp_path / "job.yaml", """\
name: destroy-error
train: {steps: 4}
recovery: {max_restarts: 0}
run: |
  "$SFTCTL_PYTHON" -c "
  import sftctl.train as t
  for s in range(1, 5):
      t.report(s, 1.0 / s)
      t.save_checkpoint({'step': s}, s)
  raise RuntimeError('ProcessGroupNCCL destroy: unhandled cuda error')
  "
""")
    proc = sftctl("run", str(spec), "--json")
    doc = json.loads(proc.stdout)
    assert (proc.returncode, doc["status"]) == (0, "SUCCEEDED"), proc.stdout + proc.stderr[-3000:]
    events = json.loads(sftctl("events", doc["id"], "--json", check=True).stdout)["events"]
    (teardown,) = [e for e in events if e["kind"] == "teardown_exit"]
    assert "RuntimeError: ProcessGroupNCCL destroy: unhandled cuda error" in teardown["message"], teardown
    assert "final checkpoint (step 4)" in teardown["message"]
    assert "warning: " in proc.stderr and "the node counts as finished" in proc.stderr
