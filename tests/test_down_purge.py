"""`sftctl down JOB --purge`: after teardown, what sftctl wrote for the job is removed (its storage
prefix's checkpoints, node streams and launch files, the workdir pack it uploaded, its local
directory) and nothing else: not the bucket, not its marker, not other objects under the prefix,
not a spec's own checkpoint_dir. On a directory storage with a running job, and on S3 (moto's
server) with exact counts."""

from __future__ import annotations

import json
import os
from pathlib import Path

import boto3
import pytest

from conftest import SLEEPER, job_processes, no_traceback, sftctl, status_json, wait_for
from sftctl import procs
from sftctl.errors import ExitCode, SftctlError


def _files(root: Path) -> dict[str, int]:
    return {str(p.relative_to(root)): p.stat().st_size for p in root.rglob("*") if p.is_file()}


def test_down_purge_of_a_running_job_on_directory_storage(tmp_path, home):
    wd = tmp_path / "wd"
    wd.mkdir()
    (wd / "train.txt").write_text("the workdir\n")
    storage = tmp_path / "storage"
    spec = tmp_path / "sleeper.yaml"
    spec.write_text(SLEEPER + f"workdir: {wd}\nstorage: {storage}\n")
    job = json.loads(sftctl("run", str(spec), "--detach", "--json", check=True).stdout)["job_id"]
    prefix = storage / job
    wait_for(lambda: status_json(job)["status"] == "RUNNING", what="RUNNING")
    wait_for(lambda: any("/node.log/" in k for k in _files(prefix)), what="node logs in the storage")
    (storage / "theirs.csv").write_text("someone else's data\n")
    (prefix / "notes.txt").write_text("the user's own object under the job's prefix\n")
    (pack,) = _files(storage / "workdir")

    proc = sftctl("down", job, "--purge", "--json")
    assert proc.returncode == 0 and no_traceback(proc), proc.stderr
    (entry,) = json.loads(proc.stdout)["down"]
    assert entry["status"] == "CANCELLED" and entry["job_id"] == job
    purged = entry["purged"]
    where = {r["where"]: r for r in purged["removed"]}
    assert set(where) == {f"file://{prefix}", f"file://{storage}/workdir/{pack}", str(home / "jobs" / job)}
    assert where[f"file://{storage}/workdir/{pack}"]["objects"] == 1
    assert all(r["objects"] > 0 and r["bytes"] > 0 for r in purged["removed"])
    assert purged["objects"] == sum(r["objects"] for r in purged["removed"])
    assert purged["kept"] == [{"where": f"file://{prefix}", "why": "1 object(s) sftctl did not write"}]
    # what is left: the storage's marker, the foreign objects; no node stream, no pack, no job dir
    assert sorted(_files(storage)) == [".sftctl-storage.json", f"{job}/notes.txt", "theirs.csv"]
    assert not (home / "jobs" / job).exists()
    assert job_processes(job) == []
    # the record stays: status and events still answer, and say what was purged
    assert status_json(job)["status"] == "CANCELLED"
    events = json.loads(sftctl("events", job, "--json", check=True).stdout)["events"]
    assert events[-1]["kind"] == "purge" and events[-1]["message"].startswith(f"purged {purged['objects']} object(s)")
    logs = sftctl("logs", job)
    assert no_traceback(logs), logs.stderr
    # idempotent: a second purge finds nothing sftctl wrote
    again = json.loads(sftctl("down", job, "--purge", "--json", check=True).stdout)["down"][0]["purged"]
    assert again["objects"] == 0 and again["bytes"] == 0


def _keys(bucket: str) -> dict[str, int]:
    s3 = boto3.client("s3")
    out = {}
    for page in s3.get_paginator("list_objects_v2").paginate(Bucket=bucket):
        out.update({o["Key"]: o["Size"] for o in page.get("Contents", [])})
    return out


def _ended_job(store, spec: dict, status: str = "CANCELLED") -> str:
    from sftctl.state import JobStatus

    job = store.create_job(spec["name"], spec)
    store.update_job(job, provider="local")
    store.transition(job, JobStatus(status), "test")
    return job


def test_down_purge_on_s3_removes_exactly_what_sftctl_wrote(home, aws, tmp_path):
    from sftctl.spec import JobSpec
    from sftctl.state import Store
    from sftctl.storage import open_storage

    s3 = boto3.client("s3")
    s3.create_bucket(Bucket="purge-me")
    spec = JobSpec.model_validate({"name": "p", "run": "true", "storage": "s3://purge-me/runs",
                                   "workdir": str(tmp_path)}).model_dump(mode="json")
    store = Store()
    job, live = _ended_job(store, spec), store.create_job("live", spec)
    # live: its controller is this process (a job with none recorded past the start grace, which a
    # loaded machine's moto puts can outlast, is reaped as dead, and its pack is no longer in use)
    store.update_job(live, controller_pid=os.getpid(), controller_start_ticks=procs.start_ticks(os.getpid()))
    open_storage("s3://purge-me/runs").ensure()  # what `sftctl run` does: the marker under the root
    sftctl_wrote = {
        f"runs/{job}/checkpoints/step-00000010/MANIFEST.json": b"{}",
        f"runs/{job}/checkpoints/step-00000010/rank-0.pt": b"w" * 3000,
        f"runs/{job}/nodes/{job}-n0/launch-1.json": b'{"script": "x"}',
        f"runs/{job}/nodes/{job}-n0/node.log/00000000": b"hello\n" * 100,
        f"runs/{job}/nodes/{job}-n0/exit-1": b"0\n",
        "runs/workdir/aaaa.tar.gz": b"z" * 777,  # this job's pack
        "runs/workdir/bbbb.tar.gz": b"y" * 555,  # another job's pack, in use
    }
    foreign = {f"runs/{job}/results.csv": b"the user's", "runs/other.csv": b"not sftctl's", "elsewhere/x": b"x"}
    for key, data in {**sftctl_wrote, **foreign}.items():
        s3.put_object(Bucket="purge-me", Key=key, Body=data)
    store.add_event(job, "storage", "workdir", {"workdir_key": "workdir/aaaa.tar.gz", "uploaded": True})
    store.add_event(job, "storage", "workdir", {"workdir_key": "workdir/bbbb.tar.gz", "uploaded": False})
    store.add_event(live, "storage", "workdir", {"workdir_key": "workdir/aaaa.tar.gz", "uploaded": False})
    marker = _keys("purge-me")["runs/.sftctl-storage.json"]

    # a live job of this state uses the pack: it stays
    doc = json.loads(sftctl("down", job, "--purge", "--json", check=True).stdout)["down"][0]["purged"]
    assert doc["removed"] == [{"where": f"s3://purge-me/runs/{job}", "objects": 5,
                               "bytes": sum(len(v) for k, v in sftctl_wrote.items() if "/workdir/" not in k)}]
    assert {"where": "s3://purge-me/runs/workdir/aaaa.tar.gz", "why": f"live job {live} uses it"} in doc["kept"]
    assert {"where": f"s3://purge-me/runs/{job}", "why": "1 object(s) sftctl did not write"} in doc["kept"]
    assert _keys("purge-me") == {**{k: len(v) for k, v in foreign.items()}, "runs/.sftctl-storage.json": marker,
                                 "runs/workdir/aaaa.tar.gz": 777, "runs/workdir/bbbb.tar.gz": 555}

    # once that job ended too, the pack this job uploaded goes (never the one it found there)
    from sftctl.state import JobStatus

    store.transition(live, JobStatus.CANCELLED, "test")
    doc = json.loads(sftctl("down", job, "--purge", "--json", check=True).stdout)["down"][0]["purged"]
    assert doc["removed"] == [{"where": f"s3://purge-me/runs/{job}", "objects": 0, "bytes": 0},
                              {"where": "s3://purge-me/runs/workdir/aaaa.tar.gz", "objects": 1, "bytes": 777}]
    assert (doc["objects"], doc["bytes"]) == (1, 777)
    assert sorted(_keys("purge-me")) == sorted([*foreign, "runs/.sftctl-storage.json", "runs/workdir/bbbb.tar.gz"])
    s3.head_bucket(Bucket="purge-me")  # a bucket the user gave is never deleted


def test_purge_keeps_your_checkpoint_dir_and_refuses_a_job_that_is_not_down(home, tmp_path):
    from sftctl.controller import purge
    from sftctl.paths import job_dir
    from sftctl.spec import JobSpec
    from sftctl.state import Store

    ckpt = tmp_path / "my-checkpoints"
    (ckpt / "step-00000005").mkdir(parents=True)
    (ckpt / "step-00000005" / "state.pt").write_bytes(b"mine" * 10)
    spec = JobSpec.model_validate({"name": "c", "run": "true", "workdir": str(tmp_path),
                                   "train": {"checkpoint_dir": str(ckpt)}}).model_dump(mode="json")
    store = Store()
    job = _ended_job(store, spec, "FAILED")
    (job_dir(job) / "nodes" / "n0").mkdir(parents=True)
    (job_dir(job) / "nodes" / "n0" / "node.log").write_bytes(b"l" * 100)
    (job_dir(job) / "controller.log").write_bytes(b"c" * 20)
    proc = sftctl("down", job, "--purge")
    assert proc.returncode == 0 and no_traceback(proc), proc.stderr
    assert proc.stdout.splitlines()[-1] == (f"{job}: purged 2 object(s), 0.0 MiB; kept {ckpt} "
                                            "(train.checkpoint_dir is yours: sftctl never deletes it)")
    assert not job_dir(job).exists()
    assert _files(ckpt) == {"step-00000005/state.pt": 40}

    pending = store.create_job("c", spec)
    with pytest.raises(SftctlError) as info:
        purge(store, pending)
    assert info.value.exit_code == ExitCode.USAGE and "\n" not in info.value.message
    assert info.value.message == f"job {pending} is PENDING: --purge removes its storage only when the job is down"
    proc = sftctl("down", "--orphans", "--purge")
    assert proc.returncode == 2 and no_traceback(proc)
    assert proc.stderr.splitlines()[0] == "error: --orphans takes no JOB, --all or --purge"
