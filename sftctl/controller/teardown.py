"""Taking jobs down: ``sftctl down`` (:func:`down`: cancel, stop the controller, remove every
node and stray process), ``down --purge`` (:func:`purge`: only what sftctl wrote for the job) and
``down --orphans`` (:func:`down_orphans`: controllers and labelled resources of jobs that are gone
or ended). These work from the state and the providers' tags alone, beside or after the job's
controller."""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import time
from pathlib import Path
from typing import Callable

from sftctl import procs
from sftctl.controller.placements import names as placement_names, placement, placement_of
from sftctl.controller.submit import checkpoint_dir_path, job_provider, job_storage_url, stop_placed_controller
from sftctl.errors import SftctlError
from sftctl.paths import CONTROLLER_OWNER, job_dir, sftctl_home
from sftctl.providers import configured, get_provider, names as provider_names
from sftctl.providers.base import NodeState, PlacesController, terminate_all
from sftctl.queue import down_reason
from sftctl.spec import JobSpec
from sftctl.state import TERMINAL, JobStatus, Store, controller_died_reason
from sftctl.storage import LocalStorage, open_storage
from sftctl.types import AttemptStatus, FailureCode


DOWN_GRACE_S = 20.0  # how long `sftctl down` lets a live controller clean up before killing it


def down(store: Store, job_id: str, progress: Callable[[str], None] | None = None, admin: str | None = None) -> str:
    """Cancel a job if it is live and remove every node and process it has. Idempotent: safe to
    run again, also while another ``down`` of it runs or after one was interrupted.

    A live controller gets SIGTERM and ``DOWN_GRACE_S`` seconds to tear down by itself (one placed
    on Slurm, ``controller.place: slurm``: its Slurm job gets it, then is ``scancel``-ed, also when
    it still waits in the queue); then this
    function terminates whatever the state and the provider's tags still show, every node at
    once (:func:`sftctl.providers.base.terminate_all`: 200 local nodes in about a second), and
    SIGKILLs a controller that did not exit. ``progress(line)``, when given, hears what it waits
    on (the controller; the nodes, with a count every few seconds of a long teardown). ``admin``:
    the server's admin taking down another user's job, named in the job's "down" events (and their
    data, ``admin``) and in its end reason (:func:`sftctl.queue.down_reason`). Returns a one-line
    summary.
    """
    from concurrent.futures import ThreadPoolExecutor

    say = progress or (lambda line: None)
    by, about = (f" by admin {admin}", {"admin": admin}) if admin else ("", {})
    job = store.get_job(job_id)
    if job is None:
        raise KeyError(job_id)
    where = placement_of(job.spec)
    # the controller to signal: a process of this machine (its pid, or its lease's holder on a
    # shared state) that the one verdict finds alive; an ended job's recorded controller may be a
    # process that went on to other things (a script that ran the job attached, a server): it is
    # never signalled, nor is this process
    verdict = where.alive(store, job, scheduler=False)
    pid, ticks = (verdict.pid, verdict.ticks) if verdict.alive else (None, None)
    controller_was_alive = bool(not job.status.terminal and pid and pid != os.getpid())
    if where.elsewhere:  # its controller is a Slurm job / Kubernetes Job, its pid another machine's
        controller_was_alive = False
        what = where.what
        if not job.status.terminal:
            store.add_event(job_id, "down", f"sftctl down{by}: SIGTERM to the controller's {what}",
                            {"signal": "SIGTERM", **about})
            say(f"{job_id}: waiting up to {DOWN_GRACE_S:.0f} s for its controller's {what} to stop its nodes")
        found = stop_placed_controller(job, DOWN_GRACE_S)
        for ctl_id in found:  # one that never started leaves its queued lease behind
            store.release_lease(job_id, where.holder(ctl_id))
        controller_was_alive = bool(found) and not job.status.terminal
    elif controller_was_alive:
        # said first, so the controller's reason names sftctl down, not an anonymous SIGTERM
        store.add_event(job_id, "down", f"sftctl down{by}: SIGTERM to the controller (pid {pid})",
                        {"signal": "SIGTERM", "controller_pid": pid, **about})
        say(f"{job_id}: waiting up to {DOWN_GRACE_S:.0f} s for its controller (pid {pid}) to stop its nodes")
        os.kill(pid, signal.SIGTERM)
        end = time.monotonic() + DOWN_GRACE_S
        while procs.alive(pid, ticks) and time.monotonic() < end:
            time.sleep(0.1)
        if procs.alive(pid, ticks):
            procs.kill_all([pid], grace_s=0)
    cancelled = store.transition(job_id, JobStatus.CANCELLED, down_reason(about), strict=False,
                                 code=FailureCode.CANCELLED.value)
    provider = job_provider(job)
    up = [n for n in store.nodes(job_id) if n.status not in (NodeState.TERMINATED.value, NodeState.REPLACED)]
    handles = [n.node_handle for n in up if n.node_handle is not None]
    if up:
        say(f"{job_id}: taking down {len(up)} node(s)")
    with ThreadPoolExecutor(max_workers=max(1, min(16, len(handles)))) as pool:  # a cloud's status is a call
        running = sum(st.state == NodeState.RUNNING for st in pool.map(provider.status, handles))
    terminate_all(provider, handles, progress=lambda line: say(f"{job_id}: {line}"))
    for node in up:
        store.update_node(node.id, status=NodeState.TERMINATED.value, handle={**node.handle, "terminated": True})
    released = len(up)
    strays = provider.terminate_tagged(job_id)
    store.end_open_attempts(job_id, AttemptStatus.ABANDONED, "the controller was gone; ended by sftctl down",
                            FailureCode.CONTROLLER_DIED.value)
    after = store.get_job(job_id)
    if not (cancelled or controller_was_alive or released or strays):
        return f"{job_id}: {after.status.value.lower()}, nothing left to take down"
    if after.status == JobStatus.FAILED_CONTROLLER:  # only a reaped controller ends a job so
        store.update_job(job_id, failure_reason=controller_died_reason(job_id, after.controller_pid, nodes_removed=True))
    parts = [f"{job_id}: " + ("cancelled" if cancelled else after.status.value.lower())
             + (by if cancelled or controller_was_alive else "")]
    if running:
        parts.append(f"stopped {running} running node(s)")
    elif controller_was_alive:
        parts.append("its controller stopped the nodes")
    else:
        parts.append("no node was running")
    if released:
        parts.append(f"released {released} node(s)")
    if strays:
        parts.append(f"killed {strays} stray process(es)")
    summary = ", ".join(parts)
    store.add_event(job_id, "down", summary, about or None)
    return summary


def purge(store: Store, job_id: str) -> dict:
    """Remove what sftctl wrote for a job that is down (``sftctl down JOB --purge``). Idempotent.

    Removed: under the job's storage prefix (``<storage>/<job id>/``) the objects of
    :data:`sftctl.storage.SFTCTL_PREFIXES` (checkpoints, node logs, metrics and health streams,
    launch requests, exit codes); the workdir pack under the storage root when this job uploaded
    it and no live job of this state uses it; the job's local directory
    (``$SFTCTL_HOME/jobs/<job id>``: local nodes, logs, default checkpoints, controller log).
    Never removed: the bucket or directory itself and its marker, anything else under the job's
    prefix, a spec's own ``train.checkpoint_dir``, a Slurm job's directory on a remote cluster;
    those that exist are listed under ``kept``. The job's record and events stay in the state.

    Returns:
        ``{"job_id", "objects", "bytes", "removed": [{"where", "objects", "bytes"}],
        "kept": [{"where", "why"}]}`` (bytes: the sizes the storage listed before deleting).

    Raises:
        KeyError: no such job.
        SftctlError: (exit 2) the job is not down: it is live, or nodes of it may still run.
        StorageError: the job's storage failed (exit 4).
    """
    import shutil

    job = store.get_job(job_id)
    if job is None:
        raise KeyError(job_id)
    alive = placement_of(job.spec).alive(store, job, scheduler=False).alive is True
    up = [n for n in store.nodes(job_id) if n.status not in (NodeState.TERMINATED, NodeState.REPLACED, NodeState.FAILED)]
    if job.status not in TERMINAL or alive or up:
        why = f"{len(up)} node(s) may still run" if up and job.status in TERMINAL else job.status.value
        raise SftctlError(f"job {job_id} is {why}: --purge removes its storage only when the job is down",
                          hint=f"sftctl down {job_id} --purge (takes it down first)")
    spec = JobSpec.model_validate(job.spec)
    removed: list[dict] = []
    kept: list[dict] = []
    url = job_storage_url(spec, job_id)
    if url is not None:
        storage = open_storage(url)
        if isinstance(storage, LocalStorage) and storage.mount is not None and not storage.mount.is_dir():
            kept.append({"where": storage.url, "why": f"the claim is not mounted here ({storage.mount})"})
        else:
            n, size = storage.delete_prefixes()
            removed.append({"where": storage.url, "objects": n, "bytes": size})
            rest = storage.list("")
            if rest:
                kept.append({"where": storage.url, "why": f"{len(rest)} object(s) sftctl did not write"})
            elif isinstance(storage, LocalStorage):
                with contextlib.suppress(OSError):
                    storage.root.rmdir()
            removed += _purge_workdir_pack(store, job_id, spec, kept)
    local = job_dir(job_id)
    if local.exists():
        files = [p for p in local.rglob("*") if p.is_file() and not p.is_symlink()]
        size = sum(p.stat().st_size for p in files)
        shutil.rmtree(local, ignore_errors=True)
        if local.exists():
            kept.append({"where": str(local), "why": "some files could not be removed"})
        removed.append({"where": str(local), "objects": len(files), "bytes": size})
    own = checkpoint_dir_path(spec)
    if own is not None and own.exists():
        kept.append({"where": str(own), "why": "train.checkpoint_dir is yours: sftctl never deletes it"})
    remote = {(n.handle or {}).get("root") for n in store.nodes(job_id)}  # a Slurm handle's job directory
    for root in sorted(r for r in remote if r and not Path(r).is_relative_to(local)):  # over ssh
        kept.append({"where": root, "why": "the job's directory on the Slurm cluster: remove it there"})
    doc = {"job_id": job_id, "objects": sum(r["objects"] for r in removed),
           "bytes": sum(r["bytes"] for r in removed), "removed": removed, "kept": kept}
    store.add_event(job_id, "purge", f"purged {doc['objects']} object(s), {doc['bytes']} bytes", doc)
    return doc


def _purge_workdir_pack(store: Store, job_id: str, spec: JobSpec, kept: list[dict]) -> list[dict]:
    """Delete the workdir pack this job uploaded to its storage root (packs are shared by content
    hash), unless a live job of this state uses the same one."""
    def packs(jid: str) -> list[dict]:
        return [e.data for e in store.events(jid) if e.kind == "storage" and (e.data or {}).get("workdir_key")]

    mine = [d for d in packs(job_id) if d.get("uploaded")]
    if not mine:
        return []
    key = mine[0]["workdir_key"]
    for other in store.list_jobs():
        if other.id == job_id or other.status in TERMINAL:
            continue
        other_spec = other.spec or {}
        if (other_spec.get("storage") or {}).get("url") == spec.storage.url and any(
                d["workdir_key"] == key for d in packs(other.id)):
            kept.append({"where": f"{spec.storage.url.rstrip('/')}/{key}", "why": f"live job {other.id} uses it"})
            return []
    root = open_storage(spec.storage.url)
    size = root.size(key)
    if size is None:
        return []
    root.delete(key)
    return [{"where": f"{root.url.rstrip('/')}/{key}", "objects": 1, "bytes": size}]


def down_orphans(store: Store | None, checked: list[str] | None = None) -> list[str]:
    """Stop every live controller, and delete every labelled resource on every configured
    provider, whose job is gone or ended.

    A job is gone when this machine's state does not know it (``store`` None: the state is
    unreadable, every job is gone); ended when its status is terminal. Controllers are found by
    their job directories' ``controller.json`` (see :func:`sftctl.queue.claim_job`), outside the state.
    Returns one summary line per job swept; ``checked`` (when given) receives the providers asked.
    """
    out = _stop_unknown_controllers(store)
    for name in provider_names():
        if configured(name) is not None:
            continue
        if checked is not None:
            checked.append(name)
        try:
            provider = get_provider(name)
            found = provider.list_instances(None)
        except SftctlError as e:
            out.append(f"{name}: skipped ({e.message})")
            continue
        for job_id in sorted({r.get("job_id") or "?" for r in found}):
            job = store.get_job(job_id) if store is not None else None
            if job is not None and not job.status.terminal:
                continue
            n = provider.terminate_tagged(job_id)
            why = "unknown job" if job is None else job.status.value.lower()
            out.append(f"{name}: {job_id} ({why}): removed {n} resource(s)")
        if isinstance(provider, PlacesController):  # controllers placed there (controller.place) of jobs gone or ended
            try:
                out += _stop_orphan_placed_controllers(store, provider, name)
            except SftctlError as e:
                out.append(f"{name}: placed controllers skipped ({e.message})")
    return out


def _what(provider: str) -> str:
    """What a provider that places controllers calls one ("Slurm job"): its placement's word."""
    return placement(provider).what if provider in placement_names() else "controller job"


def _stop_orphan_placed_controllers(store: Store | None, provider, name: str) -> list[str]:
    """Stop each placed controller (``sftctl-ctl-<job>``: a Slurm job of this home, a Kubernetes
    Job of the namespace) whose job the state does not know or that ended: SIGTERM, then
    ``scancel`` after ``DOWN_GRACE_S``; a Kubernetes Job is deleted (its pod gets the grace) with
    its Secret."""
    out = []
    for job_id in sorted({r["job_id"] or "?" for r in provider.controller_jobs(None)}):
        job = store.get_job(job_id) if store is not None else None
        if job is not None and not job.status.terminal:
            continue
        ids = provider.cancel_controller(job_id, DOWN_GRACE_S)
        why = "unknown job" if job is None else job.status.value.lower()
        out.append(f"{name}: {job_id} ({why}): stopped its controller's {_what(name)} {', '.join(ids)}")
    return out


def _stop_unknown_controllers(store: Store | None) -> list[str]:
    """SIGTERM (then SIGKILL after ``DOWN_GRACE_S``) each live controller on this host whose job
    the state does not know; its teardown removes the job's nodes. One line per controller."""
    import json

    root = sftctl_home() / "jobs"
    out = []
    for d in sorted(root.iterdir()) if root.is_dir() else []:
        try:
            owner = json.loads((d / CONTROLLER_OWNER).read_text())
            pid, ticks, host = int(owner["pid"]), owner.get("start_ticks"), owner.get("host")
        except (OSError, ValueError, KeyError, TypeError):
            continue
        if host != socket.gethostname() or not procs.alive(pid, ticks):
            continue
        if store is not None and store.get_job(d.name) is not None:
            continue  # a job the state knows: sftctl down JOB stops it
        procs.kill_all([pid], grace_s=DOWN_GRACE_S)
        out.append(f"{owner.get('provider') or 'local'}: {d.name} (unknown job): stopped its controller (pid {pid}), "
                   "which removed its nodes")
    return out
