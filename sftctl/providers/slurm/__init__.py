"""Slurm: a job is one ``sbatch`` allocation per attempt on the lab's own cluster.

Two ways to reach the cluster (:class:`SlurmConfig`):

* **login node** (no ``host``): sftctl runs where ``sinfo`` works; ``SLURM_CONF`` is honoured by
  Slurm's own commands. The job's files live under ``$SFTCTL_HOME/jobs/<job>/slurm/``, which the
  compute nodes must see (a shared filesystem, as ``$HOME`` is on nearly every cluster).
* **SSH** (``host`` set): every Slurm command and file read goes through the system ``ssh`` to the
  login node, with connection reuse (``ControlMaster=auto``, ``ControlPersist``): the first call
  opens the connection, the others ride on it (a few ms each). The job's files live under
  ``remote_dir`` on the cluster (``~/.sftctl/jobs`` by default); the spec's workdir is copied
  there once per job (a tar stream over the same connection).

Layout on the cluster (``<root>`` = the job's directory there)::

    <root>/nodes/<node id>/   the node directory of sftctl.protocol (NodeDir): the attempt's
                              script and environment (0600), its log, exit code, the Slurm node
                              it ran on and Slurm's restart count, metrics and GPU samples
    <root>/attempt-<n>/       sbatch.sh and step.sh (templates/slurm/*.j2), slurm_job_id
    <root>/slurm-<job id>.out the batch script's own output

The controller calls ``provision`` and ``launch`` once per node. ``provision`` creates nothing on
the cluster (rank 0 asks ``sbatch --test-only`` whether the allocation could ever run, so an
impossible request fails at once with exit 3); ``launch`` writes each node's script and
environment, and the launch of the last node submits the attempt's one allocation: ``--nodes``,
one task per node, GPUs (``--gpus-per-node`` or a typed ``--gres=gpu:TYPE:N`` when the partition
types its GPUs), CPUs, memory, partition, account, QOS, ``--time`` from the spec's deadline,
``--requeue``, ``--signal`` before the time limit, output files, ``--exclude`` of nodes that
failed this job, ``--comment`` carrying sftctl's labels, and ``--export=NONE`` (:data:`EXPORT_NONE`:
Slurm saves a job's environment). ``srun`` starts one step task per node, which sources that
node's 0600 environment file and runs its script; the rendezvous host is the
allocation's first node (``scontrol show hostnames``, its ``NodeAddr``).

Status: ``squeue``, then ``scontrol show job`` (both forget a job ``MinJobAge`` after it ends),
then ``sacct`` where accounting exists, then the node's exit file, which the node script writes
last. A pending job is RUNNING to the controller with ``detail`` = the pending reason in words.
A node whose allocation ended without an exit code is LOST (replaced: the next allocation
excludes its Slurm node); Slurm's own requeue (``--requeue``, after preemption or NODE_FAIL) is
followed: the job stays RUNNING and resumes from its checkpoint when it starts again.

Teardown: ``scancel``. ``list_instances`` / ``terminate_tagged`` find sftctl's jobs by their
comment (``sftctl-managed=true,sftctl-job=<job>,sftctl-home=<hash>``), only the user's own and
only those of this sftctl home.

The package, split by job (ARCHITECTURE.md, "Layout"); every name of its modules is importable
from ``sftctl.providers.slurm`` (the module ``__getattr__`` below; no list repeats them):
:mod:`~sftctl.providers.slurm.config` (pending reasons, states, the ``slurm:`` settings,
comments, GRES), :mod:`~sftctl.providers.slurm.runner` (where commands run: here or over SSH),
:mod:`~sftctl.providers.slurm.provider` (:class:`SlurmProvider`).
"""

from typing import Any

from sftctl.providers.base import ProviderEntry
from sftctl.providers.slurm import config, provider, runner
from sftctl.providers.slurm.config import configured_reason


def __getattr__(name: str) -> Any:
    """``sftctl.providers.slurm.<name>``: the name as its module defines it (config, runner,
    provider, in that order)."""
    for module in (config, runner, provider):
        if name in vars(module):
            return vars(module)[name]
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


#: A login node (``sinfo`` and a slurm.conf here) or ``slurm.host`` in the config.
PROVIDER = ProviderEntry("slurm", "SlurmProvider", configured=configured_reason)
