"""The controller: one job driven from PENDING to a terminal status, and what surrounds it.

Split by job (ARCHITECTURE.md, "Layout"):

- :mod:`~sftctl.controller.lifecycle`: the state machine (:class:`Controller`, its reporters)
  the detached controller's entry point :func:`main` (``python -m sftctl.controller JOB``) and
  :func:`adopt` (take over a job whose controller died, from Python);
- :mod:`~sftctl.controller.submit`: submit-time rules (checkpoint-dir ownership, secrets, the
  nodes' environment, job storage) and the job's provider wired to its storage;
- :mod:`~sftctl.controller.teardown`: ``sftctl down`` / ``--purge`` / ``--orphans``;
- :mod:`~sftctl.controller.launch`: admission, then a launch request (:func:`admit`,
  :class:`LaunchRequest`), which the controller executes and ``run --dry-run`` prints;
  :func:`place_controller`;
- :mod:`~sftctl.controller.placements`: where the controller runs (``controller.place``), one
  module per placement (local, server, slurm, kubernetes), found by listing the package;
- :mod:`~sftctl.controller.preview`: ``run --dry-run``'s document;
- :mod:`~sftctl.controller.ports`: the rendezvous-port allocator.

The names below are the package's public surface, re-exported from those modules.
"""

from sftctl.controller.launch import LaunchRequest, Where, admit, place_controller
from sftctl.controller.lifecycle import Cancelled, Controller, LogReporter, Reporter, adopt, main
from sftctl.controller.ports import claim_rendezvous_port, release_rendezvous_port
from sftctl.controller.preview import preview
from sftctl.controller.submit import (
    check_checkpoint_dir,
    checkpoint_dir_path,
    claim_checkpoint_dir,
    job_provider,
    job_storage_url,
    node_env,
    node_env_names,
    required_secrets,
    secret_env_keys,
)
from sftctl.controller.teardown import down, down_orphans, purge

__all__ = [
    "LaunchRequest", "Where", "admit", "place_controller",
    "Cancelled", "Controller", "LogReporter", "Reporter", "adopt", "main", "claim_rendezvous_port",
    "release_rendezvous_port", "preview", "check_checkpoint_dir", "checkpoint_dir_path",
    "claim_checkpoint_dir", "job_provider", "job_storage_url", "node_env", "node_env_names",
    "required_secrets", "secret_env_keys", "down", "down_orphans", "purge",
]
