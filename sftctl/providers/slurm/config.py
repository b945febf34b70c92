"""The Slurm provider's words and settings: squeue's pending reasons in words, job states, the
``slurm:`` section loaded (:func:`load_config`) and whether a cluster is reachable from here
(:func:`configured_reason`), sftctl's job comments, GRES parsing and ``--time``."""

from __future__ import annotations

import dataclasses
import hashlib
import os
import re
import shutil
from collections.abc import Mapping
from pathlib import Path

from sftctl import settings
from sftctl.catalog.identity import from_slurm_gres
from sftctl.errors import ProviderError
from sftctl.slurm_config import SlurmConfig

#: Pending reasons of ``squeue`` (``%r``) in words. Source: Slurm's squeue man page, "JOB REASON
#: CODES" (22.05 and 24.11 list the same codes for these).
REASONS = {
    "Resources": "waiting for resources: the nodes it needs are busy",
    "Priority": "other jobs of higher priority are ahead in the queue",
    "None": "just submitted, not yet looked at by the scheduler",
    "BeginTime": "its earliest start time has not come yet (a requeued job waits a moment)",
    "Dependency": "waiting for a job it depends on",
    "QOSMaxGRESPerUser": "your QOS's limit on GPUs per user is reached",
    "QOSMaxNodePerUserLimit": "your QOS's limit on nodes per user is reached",
    "QOSMaxJobsPerUserLimit": "your QOS's limit on running jobs per user is reached",
    "QOSGrpGRES": "the QOS's GPU limit for the whole group is reached",
    "AssocGrpGRES": "your account's GPU limit is reached",
    "AssocMaxJobsLimit": "your account's limit on running jobs is reached",
    "ReqNodeNotAvail": "a node it needs is unavailable (down, drained or reserved)",
    "PartitionNodeLimit": "it asks for more nodes than the partition allows",
    "PartitionTimeLimit": "its time limit is above the partition's",
    "PartitionDown": "the partition is down",
    "PartitionInactive": "the partition is inactive",
    "NodeDown": "a node it needs is down",
    "BadConstraints": "its constraints cannot be satisfied",
    "JobHeldUser": "held by its user (scontrol release)",
    "JobHeldAdmin": "held by an administrator",
    "Reservation": "waiting for its reservation",
    "launch failed requeued held": "its launch failed and Slurm held it",
}


def pending_words(reason: str) -> str:
    """A pending job's ``squeue`` reason code in words, keeping the code Slurm's docs use
    (``Resources: waiting for resources ...``); Slurm's ``None`` (not yet scheduled) is words only."""
    words = REASONS.get(reason, reason)
    return words if reason in ("None", words) else f"{reason}: {words}"

#: Slurm job states after which the allocation is gone (squeue's long names).
ENDED = {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "PREEMPTED", "OUT_OF_MEMORY",
         "BOOT_FAIL", "DEADLINE", "SPECIAL_EXIT", "REVOKED"}

#: What every sbatch of sftctl's passes (also written in the scripts, but the command line wins over
#: an ``SBATCH_EXPORT`` in the submitter's environment, which would win over an ``#SBATCH`` line):
#: slurmctld saves a batch job's environment in its StateSaveLocation (and, with
#: ``AccountingStoreFlags=job_env``, in the accounting database), so the job takes none of the
#: submitter's (only Slurm's ``SLURM_*``); the job's variables travel in 0600 files instead.
EXPORT_NONE = "--export=NONE"

#: Seconds before the time limit at which Slurm signals the batch script (``--signal=B:USR1@``).
SIGNAL_BEFORE_S = 90
#: How long one squeue answer serves every node of an attempt (one poll reads all nodes).
STATE_TTL_S = 0.5

COMMENT_PREFIX = "sftctl-managed=true"
#: the comment label of a job's controller run as a Slurm job (controller.place: slurm); the
#: node allocations' listing (list_instances, terminate_tagged) leaves such jobs out
CONTROLLER_ROLE = "sftctl-role=controller"


def controller_job_name(job_id: str) -> str:
    """The Slurm job name of ``job_id``'s controller (``sftctl-ctl-<job>``)."""
    return f"sftctl-ctl-{job_id}"


def load_config(spec_section: dict | None = None) -> SlurmConfig:
    """The config file's ``slurm:`` section overlaid with the spec's (``spec_section``).

    Raises:
        SettingError: the file's section has a key :class:`SlurmConfig` lacks (its line, a
            did-you-mean; exit 2).
        ProviderError: ``spec_section`` has an unknown field.
    """
    from_file = config_file_section()
    merged = {**from_file, **{k: v for k, v in (spec_section or {}).items() if v is not None}}
    fields = {f.name for f in dataclasses.fields(SlurmConfig)}
    for key in sorted(set(from_file) - fields):  # the file's line and a did-you-mean (exit 2)
        raise settings.unknown_key(f"slurm.{key}", sorted(f"slurm.{f}" for f in fields))
    unknown = sorted(set(merged) - fields)
    if unknown:
        raise ProviderError(f"slurm config: unknown field(s) {', '.join(unknown)}",
                            hint=f"fields: {', '.join(sorted(fields))}")
    if "ssh_options" in merged:
        merged["ssh_options"] = tuple(merged["ssh_options"])
    return SlurmConfig(**merged)


def config_path() -> Path | None:
    """The config file (:func:`sftctl.settings.config_path`: ``$SFTCTL_CONFIG``, else
    ``~/.config/sftctl/config.yaml``, else ``$SFTCTL_HOME/config.yaml``), or None."""
    path = settings.config_path()
    return None if path is None else Path(path)


def config_file_section() -> dict:
    """The ``slurm:`` mapping of the config file, or {} when there is none.

    Raises:
        SettingError: the file is malformed or ``slurm`` is not a mapping (exit 2).
    """
    return settings.section("slurm")[1]


def login_node_reason(environ: Mapping[str, str] | None = None) -> str | None:
    """None when Slurm's client commands work in this shell (cheap: no call), else why not."""
    env = os.environ if environ is None else environ
    if shutil.which("sinfo", path=env.get("PATH")) is None:
        return "slurm: sinfo is not on PATH (not a login node; set slurm.host in the config to use SSH)"
    conf = env.get("SLURM_CONF")
    if conf:
        return None if Path(conf).is_file() else f"slurm: SLURM_CONF={conf} does not exist"
    if any(Path(p).is_file() for p in ("/etc/slurm/slurm.conf", "/etc/slurm-llnl/slurm.conf",
                                        "/usr/local/etc/slurm.conf")):
        return None
    if Path("/run/slurm/conf/slurm.conf").is_file():  # configless: slurmd caches it here
        return None
    return "slurm: no slurm.conf (set SLURM_CONF, or slurm.host in the config to use SSH)"


def configured_reason(environ: Mapping[str, str] | None = None) -> str | None:
    """None when Slurm looks usable (an SSH host in the config, or a login node), else why not."""
    try:
        if config_file_section().get("host"):
            return None
    except (ProviderError, settings.SettingError) as e:
        return e.message
    return login_node_reason(environ)


def home_tag() -> str:
    """A short hash of this sftctl home: jobs of another home (another state, a test) are not ours."""
    from sftctl.paths import sftctl_home

    return hashlib.sha256(str(sftctl_home().resolve()).encode()).hexdigest()[:10]


def comment(job_id: str) -> str:
    return f"{COMMENT_PREFIX},sftctl-job={job_id},sftctl-home={home_tag()}"


def parse_comment(text: str) -> dict[str, str]:
    return dict(p.split("=", 1) for p in text.split(",") if "=" in p)


def accelerator_of(gpu_type: str, overrides: dict | None = None) -> str:
    """The catalog accelerator of a Slurm GPU type (``h100`` -> ``H100``), or ``""`` if unknown:
    ``slurm.gpu_types`` (``overrides``) first, then the catalog (:func:`sftctl.catalog.identity.from_slurm_gres`:
    each entry's ``identity.slurm_gres`` names, else its name with case, ``-`` and ``_`` ignored)."""
    if overrides and gpu_type in overrides:
        return overrides[gpu_type]
    return from_slurm_gres(gpu_type)


def parse_gres(text: str) -> list[tuple[str, int]]:
    """GPU entries of a ``sinfo %G`` field: ``gpu:h100:4(S:0-1),shard:8`` -> ``[("h100", 4)]``;
    an untyped ``gpu:2`` gives ``("", 2)``."""
    out = []
    for part in re.split(r",(?![^()]*\))", text or ""):
        part = re.sub(r"\(.*\)$", "", part.strip())
        bits = part.split(":")
        if bits[0] != "gpu" or len(bits) < 2:
            continue
        if len(bits) == 2:
            typ, count = "", bits[1]
        else:
            typ, count = bits[1], bits[2]
        m = re.match(r"\d+", count)
        if m:
            out.append((typ if typ != "(null)" else "", int(m.group(0))))
    return out


def duration(seconds: float) -> str:
    """``--time`` for sbatch: ``D-HH:MM:SS`` (rounded up to a minute, at least one)."""
    minutes = max(1, int(-(-seconds // 60)))
    d, rem = divmod(minutes, 1440)
    h, m = divmod(rem, 60)
    return f"{d}-{h:02d}:{m:02d}:00"
