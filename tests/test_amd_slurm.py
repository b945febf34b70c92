"""AMD GPUs on the real Slurm cluster of the tests: a node whose GRES type is an AMD part
(``gpu:mi300:2``) is planned as MI300X and launched with the ROCm environment: the GPUs Slurm
gave the step selected at ROCr's level (ROCR_VISIBLE_DEVICES) and no CUDA_VISIBLE_DEVICES /
HIP_VISIBLE_DEVICES beside it (HIP would index into ROCr's list a second time)."""

from __future__ import annotations

import json

import pytest

from conftest import sftctl, wait_for, write_spec
from slurm_cluster import SlurmCluster, skip_reason

pytestmark = pytest.mark.skipif(skip_reason() is not None, reason=skip_reason() or "")


@pytest.fixture
def amd_cluster(tmp_path, monkeypatch, home):
    with SlurmCluster(tmp_path / "slurm", nodes=1, gpus_per_node=2, gpu_type="mi300") as c:
        for k, v in c.env().items():
            monkeypatch.setenv(k, v)
        yield c
        sftctl("down", "--all")  # a test that failed midway leaves no job behind either
        # an ended Slurm job stays in squeue while Slurm completes it (COMPLETING: its epilog, the
        # steps' kill), seconds on a quiet machine and more on a busy one; one leaked never leaves.
        # Before, 30 s of the wall clock whatever the load, then an assert right after down.
        wait_for(lambda: c.jobs() == [], timeout_s=60, what="Slurm to be done with the test's jobs",
                 report=lambda: c.scontrol("show", "job"))


def test_an_amd_gres_node_is_planned_as_mi300x_and_runs_with_rocm_env(amd_cluster, tmp_path):
    spec = write_spec(tmp_path / "amd.yaml", f"""\
name: amd-job
workdir: {tmp_path}
resources: {{accelerators: ["MI300X:2"], clouds: [slurm]}}
slurm: {{cpus_per_node: 1, mem_per_node: 500M}}
health: {{enabled: false}}
run: 'echo "rocr=${{ROCR_VISIBLE_DEVICES-unset}} cuda=${{CUDA_VISIBLE_DEVICES-unset}} hip=${{HIP_VISIBLE_DEVICES-unset}}"'
""")
    plan = json.loads(sftctl("plan", str(spec), "--json", check=True).stdout)
    chosen = plan["chosen"]["offering"]
    assert (chosen["provider"], chosen["instance_type"], chosen["accelerator"]) == ("slurm", "gpu/mi300", "MI300X")
    proc = sftctl("run", str(spec), "--json", timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    doc = json.loads(proc.stdout)
    assert doc["status"] == "SUCCEEDED", doc.get("failure_reason")
    logs = sftctl("logs", doc["id"], check=True).stdout
    assert "rocr=0,1 cuda=unset hip=unset" in logs, logs[-2000:]
