"""Helpers for training scripts run by sftctl: metrics, atomic checkpoints, job configuration.

A training script imports this module on every rank::

    from sftctl import train as sft

    cfg = sft.config(steps=300)
    resumed = sft.load_latest_checkpoint()
    ...
    sft.report(step, loss, step_time_s=dt_s, tokens_per_s=tokens / dt_s)
    if step % cfg.checkpoint_interval == 0 and rank == 0:
        sft.save_checkpoint({"model": model.state_dict()}, step)
    sft.finish()  # every rank, at the end: barrier, destroy the process group, flush, exit 0

Sharded training: ``model = sft.prepare(model)`` wraps the model as the plan says
(``SFTCTL_PARALLELISM``: DDP, or FSDP2 ``fully_shard`` per block + root;
``SFTCTL_ACTIVATION_CHECKPOINTING``); build the optimizer after it. Under FSDP every rank saves
and loads together: ``sft.save_sharded_checkpoint(model, optimizer, step)`` /
``sft.load_sharded_checkpoint(model, optimizer)`` (torch.distributed.checkpoint; a checkpoint
directory then holds ``__<rank>_0.distcp`` shards, DCP's ``.metadata``, ``extra.pt`` and
``COMPLETE`` last; it resumes on any world size and any layout).

A plan whose layout splits more than the data dimension (``SFTCTL_TP``/``CP``/``EP`` > 1, issue
38) makes ``prepare`` apply :func:`sftctl.train.parallel.prepare_layout` (DTensor tensor
parallelism, all-to-all experts, FSDP2 over data x context ranks); pipeline stages run through
:func:`sftctl.train.pipeline.build_pipeline` (1F1B), and a context-parallel forward inside
:func:`sftctl.train.context_parallel.context_parallel` (ring attention). Those modules are not
re-exported (they import torch.distributed inside their functions).

The module is deliberately light: it imports only the standard library at import time. torch is
imported lazily by the functions that serialize tensors (``save_checkpoint`` and
``load_latest_checkpoint``), so the script also runs, and this module can be imported, without it.

Environment variables read (all optional):

``SFTCTL_METRICS_DIR``
    Directory for per-rank metrics files ``rank-<global rank>.jsonl``. Unset: ``report`` is a no-op.
``SFTCTL_CHECKPOINT_DIR``
    Directory holding ``step-%08d`` checkpoint directories. Default ``./checkpoints``.
``SFTCTL_KEEP_CHECKPOINTS``
    How many complete checkpoints ``save_checkpoint`` keeps when not given ``keep`` (the spec's
    ``train.keep_checkpoints``); default 3.
``SFTCTL_STORAGE_URL``
    The job's durable storage (``s3://bucket/prefix``, ``gs://bucket/prefix``, a directory; see
    :mod:`sftctl.storage`). When set, ``save_checkpoint`` also uploads every checkpoint there
    (``checkpoints/step-%08d/`` with its ``MANIFEST.json`` written last, see
    :mod:`sftctl.storage.checkpoints`) and prunes it to the same ``keep``; ``latest_checkpoint``
    and ``load_latest_checkpoint`` resume from the newest complete checkpoint of the storage or
    of the local directory, downloading it into the local directory when only the storage has
    it (a replacement node starts with an empty disk). The local directory is then a cache.
    Unset: everything stays on the local disk.
``RANK`` / ``SFTCTL_NODE_RANK``
    Global rank of this process (``RANK`` is set by torchrun); the first one set wins, else 0.
``SFTCTL_TRAIN_STEPS``, ``SFTCTL_BATCH_SIZE``, ``SFTCTL_CHECKPOINT_INTERVAL``, ``SFTCTL_DTYPE``,
``SFTCTL_JOB_ID``, ``SFTCTL_NODE_RANK``, ``SFTCTL_NUM_NODES``
    Read by ``config()``.

Checkpoint layout on disk (inside ``checkpoint_dir()``)::

    step-00000050/            a complete checkpoint: always has both files below
        state.pt              torch.save() of the state dict
        COMPLETE              {"step": 50}, written and fsynced after state.pt
    step-00000100.tmp-4242/   being written by pid 4242 (or abandoned if that pid is dead)

A checkpoint directory only ever appears under its final ``step-%08d`` name through an atomic
``os.rename`` of a fully written and fsynced temporary directory, so a crash at any point leaves
either the previous checkpoints or the new complete one, never a torn one that is picked up.
A checkpoint downloaded from job storage goes through the same temporary directory and rename.

The package, split by job (ARCHITECTURE.md, "Layout"); every name is importable from
``sftctl.train``: :mod:`~sftctl.train.report` (ranks, metrics, heartbeats),
:mod:`~sftctl.train.checkpoints` (whole checkpoints), :mod:`~sftctl.train.config` (the job's
configuration), :mod:`~sftctl.train.sharded` (DDP/FSDP2 and sharded DCP checkpoints).
"""

from sftctl import failure as _failure
from sftctl.train.checkpoints import (CheckpointSpaceError, checkpoint_dir, latest_checkpoint, load_latest_checkpoint,
                                      save_checkpoint)
from sftctl.train.config import TrainConfig, config
from sftctl.train.finish import finish
from sftctl.train.report import global_rank, report
from sftctl.train.sharded import load_sharded_checkpoint, prepare, save_sharded_checkpoint, strategy

# importable from sftctl.train as before, outside __all__: the checkpoint layout's names and helpers
from sftctl.storage.checkpoints import COMPLETE_FILE as COMPLETE_FILE
from sftctl.storage.checkpoints import DCP_METADATA as DCP_METADATA
from sftctl.storage.checkpoints import STATE_FILE as STATE_FILE
from sftctl.storage.checkpoints import complete_checkpoint_steps as complete_checkpoint_steps
from sftctl.train.checkpoints import DEFAULT_CHECKPOINT_DIR as DEFAULT_CHECKPOINT_DIR
from sftctl.train.checkpoints import DEFAULT_KEEP_CHECKPOINTS as DEFAULT_KEEP_CHECKPOINTS
from sftctl.train.checkpoints import EXTRA_FILE as EXTRA_FILE
from sftctl.train.sharded import PARALLELISMS as PARALLELISMS
from sftctl.train.sharded import blocks as blocks

# an uncaught exception in the training script lands in torchelastic's error file, so the job's
# failure reason names it (see sftctl/failure.py); no-op outside an sftctl node
_failure.install_excepthook()

__all__ = [
    "TrainConfig",
    "checkpoint_dir",
    "config",
    "global_rank",
    "latest_checkpoint",
    "load_latest_checkpoint",
    "report",
    "save_checkpoint",
    "prepare",
    "strategy",
    "save_sharded_checkpoint",
    "load_sharded_checkpoint",
    "CheckpointSpaceError",
    "finish",
]
