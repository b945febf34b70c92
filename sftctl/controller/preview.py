"""``sftctl run --dry-run``: what a job would provision and start, rendered but not done.

The dry run is :func:`sftctl.controller.launch.admit`'s :class:`~sftctl.controller.launch.LaunchRequest`
with placeholders for what only the launch knows (the job id, the nodes' addresses, the
rendezvous port, the workdir pack): the request the controller executes, so the two never drift.
Nothing is recorded, created or started."""

from __future__ import annotations

from sftctl.controller.launch import PREVIEW_JOB_ID, Where, admit
from sftctl.spec import JobSpec
from sftctl.types import Plan


def preview(spec: JobSpec, plan: Plan, job_id: str = PREVIEW_JOB_ID) -> dict:
    """What ``sftctl run`` would provision and start, rendered but not done (``run --dry-run``):
    :meth:`~sftctl.controller.launch.LaunchRequest.preview` of the request :func:`admit` makes
    for ``job_id`` with placeholders (node 0 in full, node 1 for what differs)."""
    return admit(spec, plan, Where(job_id=job_id, ranks=(0, 1))).preview()
