"""The Slurm provider: :class:`SlurmProvider` (see :mod:`sftctl.providers.slurm`)."""

from __future__ import annotations

import datetime
import os
import re
import shlex
import sys
import threading
import time
from pathlib import Path

from sftctl import settings
from sftctl.catalog import Offering
from sftctl.catalog.accelerators import find_accelerator
from sftctl.errors import CapacityError, ProviderError
from sftctl.health.platform import asked_slurm_version, requeue_option
from sftctl.protocol import CONTROLLER_HEARTBEAT, NodeDir, complete_json_lines, parse_exit_code, parse_failure
from sftctl.providers.base import NodeState, NodeStatus
from sftctl.providers.slurm.config import (
    COMMENT_PREFIX,
    CONTROLLER_ROLE,
    ENDED,
    EXPORT_NONE,
    SIGNAL_BEFORE_S,
    STATE_TTL_S,
    accelerator_of,
    comment,
    controller_job_name,
    duration,
    home_tag,
    load_config,
    login_node_reason,
    parse_comment,
    parse_gres,
    pending_words,
)
from sftctl.providers.slurm.runner import LocalRunner, Runner, SSHRunner
from sftctl.slurm_config import SlurmConfig
from sftctl.types import FailureReason, SlurmHandle


class SlurmProvider:
    """Nodes of one Slurm allocation per attempt. See the module docstring.

    Args:
        channel: ignored for now: the job's files live on the cluster's filesystem (and are read
            from there), whether or not the spec names a storage.
        config: the ``slurm:`` settings; default :func:`load_config` (the config file).
        num_nodes: nodes per allocation (the spec's ``resources.nodes``); default: as many as
            were provisioned.
        time_limit_s: ``--time`` (the spec's deadline); None: the partition's default.
        runner: where commands run (tests pass one); default from ``config.host``.
    """

    name = "slurm"

    @classmethod
    def for_plan(cls, spec=None) -> "SlurmProvider | None":
        """The provider a job ``spec`` (a :class:`~sftctl.spec.JobSpec`) runs on: the config's
        ``slurm:`` overlaid by the spec's, one allocation of ``resources.nodes``, ``--time`` from
        its deadline. The planner asks it for offerings (sinfo) and start estimates
        (:class:`~sftctl.providers.base.LiveOfferings`, ``QueueEstimate``); None without a spec
        (a partition's limits are the spec's to choose)."""
        if spec is None:
            return None
        cfg = spec.slurm.model_dump() if spec.slurm is not None else None
        return cls(config=cfg, num_nodes=spec.resources.nodes, time_limit_s=spec.resources.deadline_s)

    @classmethod
    def for_job(cls, spec, channel=None, secrets=None) -> "SlurmProvider | None":
        """The job's provider (:class:`~sftctl.providers.base.BuiltForJob`): :meth:`for_plan`'s;
        its nodes read the cluster's filesystem, never job storage, so ``channel`` is not asked."""
        return cls.for_plan(spec)

    def __init__(self, channel=None, config: SlurmConfig | dict | None = None, num_nodes: int | None = None,
                 time_limit_s: float | None = None, runner: Runner | None = None, **_: object):
        if config is None or isinstance(config, dict):
            config = load_config(config)
        self.cfg = config
        self.channel = channel
        self.num_nodes = num_nodes
        self.time_limit_s = time_limit_s
        self.runner = runner or (SSHRunner(config) if config.host else LocalRunner())
        self._lock = threading.Lock()
        self._nodes: dict[str, dict[int, str]] = {}  # job -> rank -> node id (provisioned)
        self._pending: dict[tuple[str, int], dict[int, dict]] = {}  # (job, attempt) -> rank -> launch
        self._submitted: dict[tuple[str, int], str] = {}  # (job, attempt) -> Slurm job id
        self._states: dict[str, tuple[float, dict | None]] = {}  # Slurm job id -> (when, state)
        self.excluded: set[str] = set()  # Slurm nodes that failed this job
        self.uploaded: dict[str, str] = {}  # job -> remote workdir
        self._cpu_share: dict[tuple[str, str], int | None] = {}
        self._beats: dict[str, float] = {}  # job -> when keepalive last wrote its heartbeat (monotonic)

    @property
    def remote(self) -> bool:
        """True when the cluster is reached over SSH: its filesystem is not this machine's
        (:class:`~sftctl.providers.base.ReachesFilesystem`)."""
        return self.runner.remote

    # ---------------------------------------------------------------- paths

    def job_root(self, job_id: str) -> str:
        """The job's directory on the cluster (see the module docstring)."""
        if self.runner.remote:
            base = self.cfg.remote_dir
            if base.startswith("~"):
                base = self.runner.home() + base[1:]
            return f"{base.rstrip('/')}/{job_id}"
        from sftctl.paths import job_dir

        return str(job_dir(job_id) / "slurm")

    # ---------------------------------------------------------------- protocol: cluster

    def check(self) -> None:
        """``sinfo`` answers (over SSH when ``host`` is set), else ProviderError (exit 4)."""
        if not self.runner.remote:
            why = login_node_reason()
            if why:
                raise ProviderError(why, hint="run sftctl on a login node, or set slurm.host in ~/.config/sftctl/config.yaml")
        self.runner.run(["sinfo", "-h", "-o", "%P"], timeout=30)

    def cluster(self) -> list[dict]:
        """One dict per (node, partition) from ``sinfo``: ``node``, ``partition``, ``default``,
        ``gpus`` ([(type, count)]), ``cpus``, ``memory_mb``, ``state``, ``avail``."""
        out = self.runner.run(["sinfo", "-h", "-N", "-o", "%N|%P|%G|%c|%m|%t|%a"], timeout=30).stdout.decode()
        rows = []
        for line in out.splitlines():
            bits = line.strip().split("|")
            if len(bits) != 7:
                continue
            node, part, gres, cpus, mem, state, avail = bits
            rows.append({"node": node, "partition": part.rstrip("*"), "default": part.endswith("*"),
                         "gpus": parse_gres(gres), "cpus": _int(cpus), "memory_mb": _int(mem),
                         "state": state, "avail": avail})
        return rows

    def offerings(self, accelerator: str, count: int) -> list[Offering]:
        """One offering per partition (and GPU type) whose nodes have ``count`` x ``accelerator``.

        ``cpu`` is offered by every partition with nodes of >= ``count`` CPUs. Price: the
        config's ``gpu_hour_usd`` x ``count`` per node (``cpu_hour_usd`` for cpu), 0 = owned.
        ``source`` says how many of the partition's matching nodes are idle now.
        """
        want = accelerator.lower()
        groups: dict[tuple[str, str], dict] = {}
        for r in self.cluster():
            if r["avail"] not in ("up", "UP"):
                continue
            if self.cfg.partition and r["partition"] != self.cfg.partition:
                continue
            if want == "cpu":
                if r["cpus"] < count:
                    continue
                name, gpu_type = "cpu", ""
            else:
                match = [(t, n) for t, n in r["gpus"] if n >= count and accelerator_of(t, self.cfg.gpu_types).lower() == want]
                if not match:
                    continue
                name, gpu_type = accelerator_of(match[0][0], self.cfg.gpu_types), match[0][0]
            g = groups.setdefault((r["partition"], gpu_type), {"name": name, "nodes": set(), "idle": set(),
                                                               "cpus": r["cpus"], "mem": r["memory_mb"]})
            g["nodes"].add(r["node"])
            if r["state"] in ("idle",):
                g["idle"].add(r["node"])
            g["cpus"], g["mem"] = min(g["cpus"], r["cpus"]), min(g["mem"], r["memory_mb"])
        out = []
        for (part, gpu_type), g in sorted(groups.items()):
            rate = self.cfg.cpu_hour_usd if want == "cpu" else self.cfg.gpu_hour_usd
            price = float(rate) * count
            out.append(Offering(
                provider=self.name, instance_type=f"{part}" + (f"/{gpu_type}" if gpu_type else ""),
                accelerator=g["name"], count=count, region=self.region(), usd_per_hour=price,
                spot_usd_per_hour=price, vcpus=g["cpus"] or None,
                memory_gib=round(g["mem"] / 1024, 1) if g["mem"] else None,
                source=(f"slurm partition {part}: {len(g['idle'])}/{len(g['nodes'])} node(s) idle; "
                        + ("owned (slurm.gpu_hour_usd is 0)" if not price else f"lab price {rate}/h per "
                           + ("CPU" if want == 'cpu' else "GPU"))),
                as_of=datetime.date.today().isoformat(),
            ))
        return out

    def region(self) -> str:
        return f"slurm:{self.cfg.host}" if self.cfg.host else "slurm"

    def estimate_start(self, offering: Offering, nodes: int) -> tuple[float, str]:
        """Slurm's own estimate of when an allocation for ``offering`` x ``nodes`` would start:
        ``(seconds from now, the line sbatch --test-only printed)``.

        Raises:
            CapacityError: Slurm says the allocation can never run (more nodes than the
                partition has, a GPU type it lacks, a time limit above the partition's).
        """
        argv = ["sbatch", "--test-only", EXPORT_NONE, *self._allocation_args(offering, nodes, exclude=self.excluded),
                "--wrap", "true"]
        proc = self.runner.run(argv, check=False, timeout=30)
        text = (proc.stderr or b"").decode(errors="replace").strip()
        m = re.search(r"to start at (\S+)", text)
        if proc.returncode != 0 or not m:
            line = text.splitlines()[-1] if text else f"exit code {proc.returncode}"
            line = re.sub(r"^sbatch: error: ", "", line)
            raise CapacityError(f"slurm: {offering.instance_type} cannot run {nodes} node(s) of "
                                f"{offering.accelerator}:{offering.count}: {line}", provider=self.name,
                                scope="offering", region=offering.region, instance_type=offering.instance_type)
        try:
            start = datetime.datetime.fromisoformat(m.group(1))
            wait = max(0.0, (start - datetime.datetime.now()).total_seconds())
        except ValueError:
            wait = 0.0
        return wait, text.removeprefix("sbatch: ")

    # ---------------------------------------------------------------- protocol: nodes

    def provision(self, job_id: str, node_id: str, rank: int, offering: Offering, **_: object) -> SlurmHandle:
        """Record the node (no Slurm call creates anything); rank 0 checks with ``sbatch
        --test-only`` that the allocation can run at all (CapacityError if not)."""
        with self._lock:
            self._nodes.setdefault(job_id, {})[rank] = node_id
        if rank == 0:
            self.estimate_start(offering, self.num_nodes or 1)
        root = self.job_root(job_id)
        return SlurmHandle(job_id=job_id, node_id=node_id, rank=rank, root=root, dir=f"{root}/nodes/{node_id}",
                           offering=offering.to_dict(), exclude=sorted(self.excluded))

    def launch(self, handle: SlurmHandle, script: str, env: dict[str, str], attempt: int) -> SlurmHandle:
        """Write the node's script and environment; the last node's launch submits the attempt."""
        job_id, rank = handle.job_id, handle.rank
        with self._lock:
            nodes = self._nodes.setdefault(job_id, {})
            nodes[rank] = handle.node_id
            pending = self._pending.setdefault((job_id, attempt), {})
            pending[rank] = {"handle": handle, "script": script, "env": env}
            total = self.num_nodes or len(nodes)
            ready = len(pending) >= total
        handle = handle.with_(attempt=attempt)
        if not ready:
            return handle
        slurm_id = self._submit(job_id, attempt, [pending[r] for r in sorted(pending)])
        with self._lock:
            self._pending.pop((job_id, attempt), None)
        return handle.with_(slurm_job_id=slurm_id)

    def keepalive(self, job_id: str) -> None:
        """The controller watches ``job_id``: rewrite ``<job root>/controller.heartbeat`` (a
        timestamp) at most every ``grace / 5`` seconds (1 to 30 s). sbatch.sh cancels its own
        allocation when the file's content has not changed for ``SFTCTL_SLURM_CONTROLLER_GRACE_S``
        by the compute node's clock (so clock skew between hosts does not matter)."""
        grace = settings.get("SFTCTL_SLURM_CONTROLLER_GRACE_S")
        if not grace:
            return
        now = time.monotonic()
        if now - self._beats.get(job_id, -1e9) < max(1.0, min(30.0, grace / 5)):
            return
        self._beats[job_id] = now
        self.runner.write_files({f"{self.job_root(job_id)}/{CONTROLLER_HEARTBEAT}": (f"{time.time():.3f}\n", 0o600)})

    def _submit(self, job_id: str, attempt: int, launches: list[dict]) -> str:
        root = self.job_root(job_id)
        offering = Offering(**launches[0]["handle"].offering)
        workdir = None
        files: dict[str, tuple[str, int]] = {}
        python = self.cfg.python or (None if self.runner.remote else sys.executable)
        for item in launches:
            h, env = item["handle"], dict(item["env"])
            node_dir = h.dir
            nd = NodeDir(node_dir)
            if self.runner.remote:  # the nodes see the cluster's filesystem, not this machine's
                workdir = workdir or self._upload_workdir(job_id, root)
                env["SFTCTL_WORKDIR"] = workdir
                if (settings.raw("SFTCTL_CHECKPOINT_DIR", env) or "").startswith(_local_jobs_dir()):
                    env["SFTCTL_CHECKPOINT_DIR"] = f"{root}/checkpoints"
            env.update(SFTCTL_JOB_ID=job_id, SFTCTL_NODE_ID=h.node_id, SFTCTL_NODE_DIR=node_dir,
                       SFTCTL_METRICS_DIR=nd.metrics)
            # with job storage the nodes' own checkpoint copies stay in the node's directory,
            # never in the (shared) workdir, as a cloud node keeps them on its own disk
            env.setdefault("SFTCTL_CHECKPOINT_DIR", f"{node_dir}/checkpoints")
            if python:
                env["SFTCTL_PYTHON"] = python
            files[nd.script(attempt)] = (item["script"], 0o700)
            files[nd.env(attempt)] = ("".join(f"export {k}={shlex.quote(str(v))}\n" for k, v in env.items()), 0o600)
            files[f"{nd.metrics}/.keep"] = ("", 0o600)
        node_ids = [item["handle"].node_id for item in launches]
        adir = f"{root}/attempt-{attempt}"
        for name, text in self.batch_scripts(job_id, attempt, node_ids, offering).items():
            files[f"{adir}/{name}"] = (text, 0o700)
        files[f"{root}/{CONTROLLER_HEARTBEAT}"] = (f"{time.time():.3f}\n", 0o600)
        self._beats[job_id] = time.monotonic()
        self.runner.write_files(files)
        proc = self.runner.run(["sbatch", EXPORT_NONE, "--parsable", f"{adir}/sbatch.sh"], check=False, timeout=60)
        if proc.returncode != 0:
            err = (proc.stderr or b"").decode(errors="replace").strip()
            line = re.sub(r"^sbatch: error: ", "", err.splitlines()[-1] if err else f"exit code {proc.returncode}")
            raise CapacityError(f"slurm: sbatch refused attempt {attempt}: {line}", provider=self.name,
                                scope="offering", region=offering.region, instance_type=offering.instance_type)
        slurm_id = proc.stdout.decode().strip().split(";")[0]
        self.runner.write_files({f"{adir}/slurm_job_id": (slurm_id + "\n", 0o600)})
        with self._lock:
            self._submitted[(job_id, attempt)] = slurm_id
        return slurm_id

    def batch_scripts(self, job_id: str, attempt: int, node_ids: list[str], offering: Offering) -> dict[str, str]:
        """``{"sbatch.sh", "step.sh"}``: the text of the attempt's allocation script and of the
        step every node runs, as :meth:`launch` submits them (``run --dry-run`` shows them).

        Raises:
            ValueError: a value bound for an ``#SBATCH`` line holds a control character (the
                settings refuse those first: :func:`sftctl.slurm_config.control_problem`).
        """
        from sftctl.templates import render

        root = self.job_root(job_id)
        python = self.cfg.python or (None if self.runner.remote else sys.executable)
        opts = self._allocation_args(offering, len(node_ids), exclude=self.excluded)
        grace = settings.get("SFTCTL_SLURM_CONTROLLER_GRACE_S")
        return {
            "sbatch.sh": render("slurm/sbatch.sh.j2", job_id=job_id, attempt=attempt, root=root, options=opts,
                                nodes=len(node_ids), signal_s=SIGNAL_BEFORE_S, comment=comment(job_id),
                                requeue=requeue_option(self.cfg.requeue, asked_slurm_version(self.runner)),
                                grace_s=int(round(grace)),
                                check_s=max(1, min(30, int(grace // 10) or 1))),
            # an AMD accelerator's step runs with the ROCm environment (step.sh.j2 says why)
            "step.sh": render("slurm/step.sh.j2", job_id=job_id, attempt=attempt, root=root, node_ids=node_ids,
                              python_dir=str(Path(python).parent) if python else "",
                              gpu_vendor=getattr(find_accelerator(offering.accelerator), "vendor", "")),
        }

    # ---------------------------------------------------------------- the job's controller

    def controller_script(self, job_id: str, argv: list[str], *, partition: str | None, log: str, chdir: str,
                          time_limit_s: float | None = None) -> str:
        """The batch script that runs ``job_id``'s controller (``argv``: ``python -m sftctl.queue
        JOB``, :func:`sftctl.procs.module_argv`) as one 1-CPU task in ``partition`` (default: the
        config's partition, else the cluster's default), appending its output to ``log``;
        ``--time`` is ``time_limit_s`` (None: the partition's default time limit).

        Raises:
            ValueError: a value bound for an ``#SBATCH`` line holds a control character.
        """
        from sftctl.templates import render

        options = []
        if partition or self.cfg.partition:
            options.append(f"--partition={partition or self.cfg.partition}")
        if self.cfg.account:
            options.append(f"--account={self.cfg.account}")
        if self.cfg.qos:
            options.append(f"--qos={self.cfg.qos}")
        if time_limit_s:
            options.append(f"--time={duration(time_limit_s)}")
        return render("slurm/controller.sh.j2", job_id=job_id, slurm_name=controller_job_name(job_id), options=options,
                      log=log, chdir=chdir, comment=f"{comment(job_id)},{CONTROLLER_ROLE}", argv=argv,
                      env_file=self.controller_env_path(job_id))

    def controller_env_path(self, job_id: str) -> str:
        """The 0600 file that carries the environment of ``job_id``'s controller Slurm job
        (``<job root>/controller.env``): written by :meth:`submit_controller`, read and deleted by
        the batch script when it starts."""
        return f"{self.job_root(job_id)}/controller.env"

    def submit_controller(self, job_id: str, argv: list[str], *, partition: str | None, log: str,
                          chdir: str, time_limit_s: float | None = None, env: dict[str, str] | None = None) -> str:
        """Write ``env`` (the controller's environment: the state's URL, the secrets' values...)
        to :meth:`controller_env_path` (0600) and :meth:`controller_script` to ``<job
        root>/controller.sbatch.sh``, and ``sbatch --export=NONE`` it; return the Slurm job id.
        The job is ``--no-requeue``; Slurm keeps none of the submitter's environment (only its
        ``SLURM_*``, ``SLURM_CONF`` among them): the script reads ``env`` from the file and
        deletes it.

        Raises:
            ProviderError: sbatch refused it (an unknown partition, an account limit), exit 4.
        """
        path = f"{self.job_root(job_id)}/controller.sbatch.sh"
        env_text = "".join(f"export {k}={shlex.quote(str(v))}\n" for k, v in (env or {}).items())
        self.runner.write_files({self.controller_env_path(job_id): (env_text, 0o600),
                                 path: (self.controller_script(job_id, argv, partition=partition, log=log,
                                                               chdir=chdir, time_limit_s=time_limit_s), 0o700)})
        proc = self.runner.run(["sbatch", EXPORT_NONE, "--parsable", path], check=False, timeout=60)
        if proc.returncode != 0:
            self.runner.run(["rm", "-f", self.controller_env_path(job_id)], check=False)  # no one will read it
            err = (proc.stderr or b"").decode(errors="replace").strip()
            line = re.sub(r"^sbatch: error: ", "", err.splitlines()[-1] if err else f"exit code {proc.returncode}")
            raise ProviderError(f"slurm: sbatch refused the controller of job {job_id}: {line}",
                                hint="controller.partition (or slurm.partition) names a partition of the cluster? "
                                     "sinfo lists them")
        return proc.stdout.decode().strip().split(";")[0]

    def controller_jobs(self, job_id: str | None = None) -> list[dict]:
        """The live Slurm jobs running (or waiting to run) a controller of this sftctl home:
        ``[{"id", "job_id", "state", "name"}]``, of ``job_id`` only when given."""
        by_name = ["--name", controller_job_name(job_id)] if job_id is not None else []
        proc = self.runner.run(["squeue", "-h", *by_name, "-o", "%i|%T|%j|%k"], check=False)
        out, mine = [], home_tag()
        for line in proc.stdout.decode().splitlines():
            bits = line.strip().split("|", 3)
            if len(bits) != 4 or CONTROLLER_ROLE not in bits[3]:
                continue
            labels = parse_comment(bits[3])
            if labels.get("sftctl-home") != mine or (job_id is not None and labels.get("sftctl-job") != job_id):
                continue
            out.append({"id": bits[0], "job_id": labels.get("sftctl-job"), "state": bits[1], "name": bits[2]})
        return out

    def cancel_controller(self, job_id: str, grace_s: float = 20.0) -> list[str]:
        """Stop ``job_id``'s controller jobs: a running one gets SIGTERM (``scancel --batch
        --signal=TERM``: the controller cancels the job and stops its nodes itself) and
        ``grace_s`` seconds to end; what is still in the queue then is cancelled outright; the
        controller's environment file (:meth:`controller_env_path`) is deleted. Returns the Slurm
        job ids it found."""
        found = self.controller_jobs(job_id)
        running = [f["id"] for f in found if f["state"] in ("RUNNING", "CONFIGURING")]
        waiting = [f["id"] for f in found if f["id"] not in running]
        if waiting:
            self.runner.run(["scancel", *waiting], check=False)
        if running:
            self.runner.run(["scancel", "--batch", "--signal=TERM", *running], check=False)
            end = time.monotonic() + grace_s
            while time.monotonic() < end and any(f["state"] in ("RUNNING", "CONFIGURING")
                                                 for f in self.controller_jobs(job_id)):
                time.sleep(0.5)
            left = [f["id"] for f in self.controller_jobs(job_id) if f["state"] not in ("COMPLETING",)]
            if left:
                self.runner.run(["scancel", *left], check=False)
        # a controller cancelled (or scancelled) before it started never read and deleted it; the
        # id may come from any Slurm job's comment (down --orphans): a plain name only, no path
        if re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9._-]*", job_id):
            self.runner.run(["rm", "-f", self.controller_env_path(job_id)], check=False)
        return [f["id"] for f in found]

    def _upload_workdir(self, job_id: str, root: str) -> str:
        if job_id not in self.uploaded:
            from sftctl.state import Store

            job = Store().get_job(job_id)
            local = (job.spec.get("workdir") if job is not None else None) or "."
            remote = f"{root}/workdir"
            self.runner.upload_dir(local, remote)
            self.uploaded[job_id] = remote
        return self.uploaded[job_id]

    def _allocation_args(self, offering: Offering, nodes: int, exclude=()) -> list[str]:
        """sbatch options of an allocation: ``nodes`` x ``offering`` (see the module docstring)."""
        part, _, gpu_type = offering.instance_type.partition("/")
        args = [f"--nodes={nodes}", "--ntasks-per-node=1", f"--partition={self.cfg.partition or part}"]
        if offering.accelerator.lower() != "cpu":
            args.append(f"--gres=gpu:{gpu_type}:{offering.count}" if gpu_type else f"--gpus-per-node={offering.count}")
            cpus = self.cfg.cpus_per_node or self._gpu_share_of_cpus(part, gpu_type, offering.count)
            if cpus:
                args.append(f"--cpus-per-task={cpus}")
        else:
            args.append(f"--cpus-per-task={self.cfg.cpus_per_node or offering.count}")
        if self.cfg.mem_per_node:
            args.append(f"--mem={self.cfg.mem_per_node}")
        if self.cfg.account:
            args.append(f"--account={self.cfg.account}")
        if self.cfg.qos:
            args.append(f"--qos={self.cfg.qos}")
        if self.time_limit_s:
            args.append(f"--time={duration(self.time_limit_s)}")
        if exclude:
            args.append(f"--exclude={','.join(sorted(exclude))}")
        return args

    def _gpu_share_of_cpus(self, partition: str, gpu_type: str, gpus: int) -> int | None:
        """CPUs for one task that drives ``gpus`` GPUs: the node's CPUs in proportion to the GPUs
        asked (all of them for a whole node), from ``sinfo``; None when sinfo does not say.
        Without it Slurm gives the task one CPU, and torchrun's workers would share it."""
        key = (partition, gpu_type)
        if key not in self._cpu_share:
            share = None
            for r in self.cluster():
                if r["partition"] != partition:
                    continue
                total = sum(n for t, n in r["gpus"] if not gpu_type or t == gpu_type)
                if total and r["cpus"]:
                    one = r["cpus"] // total
                    share = one if share is None else min(share, one)
            self._cpu_share[key] = share
        share = self._cpu_share[key]
        return max(1, share * gpus) if share else None

    # ---------------------------------------------------------------- status

    def slurm_id(self, handle: SlurmHandle) -> str | None:
        """The Slurm job of the handle's attempt: from the handle, this process, or the cluster."""
        if handle.slurm_job_id:
            return handle.slurm_job_id
        key = (handle.job_id, handle.attempt)
        if key in self._submitted:
            return self._submitted[key]
        if not handle.attempt:
            return None
        path = f"{handle.root}/attempt-{handle.attempt}/slurm_job_id"
        data = self.runner.read({"files": {path: 0}}).get(path)
        if data and data.strip():
            with self._lock:
                self._submitted[key] = data.decode().strip()
            return self._submitted[key]
        return None

    def job_state(self, slurm_id: str, fresh: bool = False) -> dict | None:
        """``{"state", "reason", "nodes", "restarts", "source"}`` of a Slurm job, or None when Slurm
        has forgotten it. squeue first, then ``scontrol show job``, then ``sacct``."""
        now = time.monotonic()
        cached = self._states.get(slurm_id)
        if cached and not fresh and now - cached[0] < STATE_TTL_S:
            return cached[1]
        state = self._query_state(slurm_id)
        self._states[slurm_id] = (now, state)
        return state

    def _query_state(self, slurm_id: str) -> dict | None:
        proc = self.runner.run(["squeue", "-h", "-j", slurm_id, "-o", "%T|%r|%N"], check=False)
        line = proc.stdout.decode().strip()
        if proc.returncode == 0 and line:
            state, reason, nodes = (line.split("|") + ["", ""])[:3]
            out = {"state": state, "reason": reason, "nodes": nodes, "source": "squeue"}
            if state == "PENDING":  # was it requeued? (squeue does not say; scontrol does)
                f = dict(re.findall(r"(\w+)=(\S*)", self.runner.run(["scontrol", "show", "job", "-o", slurm_id],
                                                                     check=False).stdout.decode()))
                out["restarts"] = _int(f.get("Restarts", "0"))
            return out
        proc = self.runner.run(["scontrol", "show", "job", "-o", slurm_id], check=False)
        text = proc.stdout.decode()
        if proc.returncode == 0 and "JobState=" in text:
            f = dict(re.findall(r"(\w+)=(\S*)", text))
            return {"state": f.get("JobState", ""), "reason": f.get("Reason", ""),
                    "nodes": f.get("NodeList", ""), "restarts": _int(f.get("Restarts", "0")), "source": "scontrol"}
        proc = self.runner.run(["sacct", "-n", "-P", "-X", "-j", slurm_id, "-o", "State,Reason,NodeList"], check=False)
        line = proc.stdout.decode().strip().splitlines()
        if proc.returncode == 0 and line and line[0].strip():
            state, reason, nodes = (line[0].split("|") + ["", ""])[:3]
            return {"state": state.split()[0], "reason": reason, "nodes": nodes, "source": "sacct"}
        return None

    def _files(self, handle: SlurmHandle, offsets: dict | None = None, log_offset: int | None = None) -> dict[str, bytes]:
        """The attempt's exit, host and restarts files (and ``node.log`` from ``log_offset``) in one read."""
        d, a = NodeDir(handle.dir), handle.attempt
        files = {d.exit(a): 0, d.host(a): 0, d.restarts(a): 0}
        if log_offset is not None:
            files[d.log] = log_offset
        return self.runner.read({"files": files})

    def _host(self, handle: SlurmHandle, got: dict[str, bytes]) -> str:
        """The Slurm node the attempt ran on, from a :meth:`_files` answer ("" while unknown)."""
        return (got.get(NodeDir(handle.dir).host(handle.attempt)) or b"").decode().strip()

    def exit_code(self, handle: SlurmHandle) -> int | None:
        return parse_exit_code(self._files(handle).get(NodeDir(handle.dir).exit(handle.attempt)))

    def status(self, handle: SlurmHandle) -> NodeStatus:
        if handle.terminated:
            return NodeStatus(NodeState.TERMINATED)
        if not handle.attempt:
            return NodeStatus(NodeState.READY)
        got = self._files(handle)
        nd = NodeDir(handle.dir)
        code = parse_exit_code(got.get(nd.exit(handle.attempt)))
        if code is not None:
            return NodeStatus(NodeState.SUCCEEDED if code == 0 else NodeState.FAILED, code, f"exit code {code}")
        slurm_id = self.slurm_id(handle)
        if slurm_id is None:
            return NodeStatus(NodeState.RUNNING, None, "waiting for the other nodes' launch")
        st = self.job_state(slurm_id)
        host = self._host(handle, got)
        if st is None:
            if self.exit_code(handle) is not None:
                return self.status(handle)
            return NodeStatus(NodeState.LOST, None, f"Slurm no longer knows job {slurm_id} and node "
                                                    f"{handle.rank} wrote no exit code")
        state = st["state"]
        if state == "PENDING":
            reason = st.get("reason") or "None"
            again = (f" (requeued by Slurm, restart {st['restarts']}: it resumes from the last checkpoint)"
                     if st.get("restarts") else "")
            return NodeStatus(NodeState.RUNNING, None, f"pending in Slurm job {slurm_id}: {pending_words(reason)}{again}",
                              pending=True)
        if state not in ENDED:
            restarts = _int((got.get(nd.restarts(handle.attempt)) or b"0").decode())
            if state == "RUNNING" and restarts:
                return NodeStatus(NodeState.RUNNING, None, f"Slurm job {slurm_id} runs again after Slurm requeued it "
                                                           f"(restart {restarts}, on {host or 'a new node'}): "
                                                           "resumed from the last checkpoint")
            return NodeStatus(NodeState.RUNNING, None, "" if state == "RUNNING" else f"Slurm job {slurm_id} {state.lower()}")
        code = self.exit_code(handle)  # the allocation ended: the node may have written it just now
        if code is not None:
            return NodeStatus(NodeState.SUCCEEDED if code == 0 else NodeState.FAILED, code, f"exit code {code}")
        where = f" on {host}" if host else ""
        if state == "NODE_FAIL" and host and not self._node_down(host):
            # another node of the allocation failed: this one waits for the replacement's relaunch
            return NodeStatus(NodeState.RUNNING, None, f"Slurm job {slurm_id} NODE_FAIL (not this node)")
        if state == "TIMEOUT":
            return NodeStatus(NodeState.FAILED, None, f"Slurm job {slurm_id} hit its time limit{where}")
        detail = (f"Slurm job {slurm_id} ended {state}{where} ({st.get('reason') or 'no reason given'}) "
                  "without an exit code")
        if host and self._node_down(host):  # draining needs admin rights: sftctl only leaves it out
            detail += (f"; Slurm node {host} is down: sftctl leaves it out of this job's allocations "
                       f"(--exclude); an admin should look at it (scontrol show node {host})")
        return NodeStatus(NodeState.LOST, None, detail)

    def _node_down(self, host: str) -> bool:
        proc = self.runner.run(["sinfo", "-h", "-N", "-n", host, "-o", "%t"], check=False)
        states = proc.stdout.decode().split()
        return not states or any(s.rstrip("*~#!%$@^-") in ("down", "drain", "drng", "fail", "failg", "unk", "boot")
                                 or s.endswith("*") for s in states)

    def read_log(self, handle: SlurmHandle, offset: int) -> tuple[bytes, int]:
        if not handle.dir:
            return b"", offset
        path = NodeDir(handle.dir).log
        data = self.runner.read({"files": {path: offset}}).get(path, b"")
        return data, offset + len(data)

    def read_metrics(self, handle: SlurmHandle, offsets: dict[str, int]) -> list[dict]:
        if not handle.dir:
            return []
        pattern = NodeDir(handle.dir).metrics_glob
        got = self.runner.read({"globs": [pattern], "files": {p: o for p, o in offsets.items() if p.startswith(handle.dir)}})
        out = []
        for path in sorted(got):
            if not path.endswith(".jsonl"):
                continue
            out += complete_json_lines(path, got[path], offsets)
        return out

    def read_health(self, handle: SlurmHandle, offsets: dict[str, int]) -> list[dict]:
        if not handle.dir:
            return []
        path = NodeDir(handle.dir).health
        got = self.runner.read({"files": {path: offsets.get(path, 0)}})
        return complete_json_lines(path, got[path], offsets) if path in got else []

    def read_failure(self, handle: SlurmHandle) -> FailureReason | None:
        if not handle.dir or not handle.attempt:
            return None
        path = NodeDir(handle.dir).failure(handle.attempt)
        return parse_failure(self.runner.read({"files": {path: 0}}).get(path))

    # ---------------------------------------------------------------- teardown

    def stop_attempt(self, handle: SlurmHandle) -> None:
        """Cancel the attempt's allocation (every node of it); the next attempt submits anew."""
        self._cancel(handle)

    def quarantine(self, handle: SlurmHandle, reason: str) -> dict | None:
        """Put the Slurm node the attempt ran on (the protocol's host file) on this job's
        ``--exclude`` list, whatever the allocation's state (draining it needs admin rights:
        sftctl only leaves it out). None when the node never wrote its host name."""
        if not (handle.attempt and handle.dir):
            return None
        host = self._host(handle, self._files(handle))
        if not host:
            return None
        self.excluded.add(host)
        return {"machine": host, "actions": ["exclude"],
                "message": f"slurm: node {host} is left out of this job's next allocations (--exclude): {reason}"}

    def keep_out(self, job_id: str, machines: set[str]) -> set[str]:
        """Put ``machines`` (Slurm node names the state marks bad) on this job's ``--exclude``
        list; returns those not on it yet."""
        new = set(machines) - self.excluded
        self.excluded |= set(machines)
        return new

    def terminate(self, handle: SlurmHandle) -> None:
        """Cancel the allocation of the node's attempt. The Slurm node it ran on goes on this
        job's ``--exclude`` list unless the allocation ended for a reason that is not the node's
        (cancelled, preempted, out of time): a node replaced for a health verdict or a lost
        heartbeat, or one Slurm reports down, is never given to this job again."""
        if handle.attempt and handle.dir:
            host = self._host(handle, self._files(handle))
            slurm_id = self.slurm_id(handle)
            st = self.job_state(slurm_id, fresh=True) if slurm_id else None
            innocent = st is not None and st["state"] in ("CANCELLED", "PREEMPTED", "TIMEOUT", "COMPLETED", "DEADLINE")
            if host and (not innocent or self._node_down(host)):
                self.excluded.add(host)
        self._cancel(handle)

    def _cancel(self, handle: SlurmHandle) -> None:
        with self._lock:
            self._pending.pop((handle.job_id, handle.attempt), None)
        slurm_id = self.slurm_id(handle) if handle.attempt and handle.root else None
        if slurm_id:
            self.runner.run(["scancel", slurm_id], check=False)
            self._states.pop(slurm_id, None)
        if handle.attempt and handle.dir:  # the attempt is over: its secret values go with it
            self.runner.run(["rm", "-f", NodeDir(handle.dir).env(handle.attempt)], check=False)

    def list_instances(self, job_id: str | None = None) -> list[dict]:
        """The user's live Slurm jobs whose comment carries sftctl's labels and this home (node
        allocations only: a controller's Slurm job is :meth:`controller_jobs`')."""
        user = ["--me"] if not self.runner.remote and os.geteuid() != 0 else ["-u", self.cfg.user] if self.cfg.user else ["--me"]
        proc = self.runner.run(["squeue", "-h", *user, "-o", "%i|%T|%k"], check=False)
        if proc.returncode != 0:
            proc = self.runner.run(["squeue", "-h", "-o", "%i|%T|%k"], check=False)
        out = []
        mine = home_tag()
        for line in proc.stdout.decode().splitlines():
            bits = line.strip().split("|", 2)
            if len(bits) != 3 or COMMENT_PREFIX not in bits[2] or CONTROLLER_ROLE in bits[2]:
                continue  # a controller's own Slurm job is not a node (its teardown calls this)
            labels = parse_comment(bits[2])
            if labels.get("sftctl-home") != mine:
                continue
            if job_id is None or labels.get("sftctl-job") == job_id:
                out.append({"id": bits[0], "job_id": labels.get("sftctl-job"), "node_id": None, "state": bits[1]})
        return out

    def terminate_tagged(self, job_id: str) -> int:
        found = self.list_instances(job_id)
        if found:
            self.runner.run(["scancel", *[f["id"] for f in found]], check=False)
        return len(found)


def _int(text: str) -> int:
    m = re.match(r"\d+", str(text).strip())
    return int(m.group(0)) if m else 0


def _local_jobs_dir() -> str:
    from sftctl.paths import sftctl_home

    return str(sftctl_home() / "jobs")
