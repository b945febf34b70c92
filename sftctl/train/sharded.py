"""The planned data-parallel strategy (:func:`strategy`, :func:`prepare`: DDP or FSDP2 with
activation checkpointing) and sharded (DCP) checkpoints (:func:`save_sharded_checkpoint`,
:func:`load_sharded_checkpoint`)."""

from __future__ import annotations

import json
import os
import shutil
import sys
from pathlib import Path
from typing import Any

from sftctl import preflight as _preflight
from sftctl import settings
from sftctl.storage.checkpoints import (
    COMPLETE_FILE,
    DCP_METADATA,
    STATE_FILE,
    begin_checkpoint,
    upload_files,
    write_manifest,
)
from sftctl.storage.checkpoints import read_complete_marker as _read_complete
from sftctl.train.checkpoints import (
    EXTRA_FILE,
    _checkpoint_args,
    _download_checkpoint,
    _fsync_dir,
    _job_storage,
    _prune,
    _space_error,
    _step_name,
    checkpoint_dir,
    latest_checkpoint,
)
from sftctl.train.config import config
from sftctl.train.mesh import layout
from sftctl.train.parallel import prepare_layout
from sftctl.train.report import global_rank

PARALLELISMS = ("ddp", "fsdp")


def strategy() -> tuple[str, bool]:
    """The planned strategy from the environment: ``(parallelism, activation_checkpointing)``.

    ``SFTCTL_PARALLELISM``: ``ddp`` (default) or ``fsdp``; ``SFTCTL_ACTIVATION_CHECKPOINTING``:
    ``1``/``0`` (default ``0``). The controller sets both from the plan.

    Raises:
        ValueError: another value; the message names the variable.
    """
    return settings.get("SFTCTL_PARALLELISM"), settings.get("SFTCTL_ACTIVATION_CHECKPOINTING")


def blocks(model: Any) -> list:
    """The model's repeated blocks: the entries of its largest ``nn.ModuleList`` (by parameters),
    e.g. a GPT's ``blocks`` or a Llama's ``model.layers``; [] when it has none. These are the FSDP
    units and the activation-checkpointing units (see :mod:`sftctl.compiler.sharding`)."""
    import torch.nn as nn

    lists = [m for m in model.modules() if isinstance(m, nn.ModuleList) and len(m) > 0]
    if not lists:
        return []
    best = max(lists, key=lambda ml: sum(p.numel() for p in ml.parameters()))
    return list(best)


def _log(msg: str) -> None:
    if global_rank() == 0:
        print(f"sftctl.train: {msg}", file=sys.stderr, flush=True)


def prepare(model: Any, *, parallelism: str | None = None, activation_checkpointing: bool | None = None,
            dtype: str | None = None, loss_fn: Any = None) -> Any:
    """Wrap ``model`` (on its device already) the way the plan says; call it once, before
    building the optimizer, and train the module it returns.

    * ``ddp``: ``DistributedDataParallel`` when the process group is initialized with more than
      one rank; the model as it is otherwise. Mixed precision stays the script's autocast.
    * ``fsdp``: FSDP2, ``fully_shard`` on each block (:func:`blocks`) and then on the root, with
      ``MixedPrecisionPolicy(param_dtype=dtype, reduce_dtype=float32)`` when ``dtype`` is
      bfloat16/float16 (parameters gathered and computed in that dtype, float32 master weights,
      gradients reduce-scattered in float32). Parameters become sharded DTensors: save them with
      :func:`save_sharded_checkpoint`. If sharding fails (a model FSDP2 cannot wrap, a backend
      without the collectives it needs), it logs one line saying why and falls back to DDP.
    * a layout with tensor, context or expert parallelism (``SFTCTL_TP`` / ``SFTCTL_CP`` /
      ``SFTCTL_EP`` > 1): :func:`sftctl.train.parallel.prepare_layout` (DTensor tensor
      parallelism, all-to-all experts, FSDP2 over ``dp`` x ``cp``).
    * pipeline stages (``SFTCTL_PP`` > 1, planned only for a spec with ``train.pipeline: true``):
      given ``loss_fn(output, target)``, a :class:`sftctl.train.pipeline.Pipeline` (this rank's
      stage as ``.module``, ``.step(inputs, targets)`` runs the 1F1B or interleaved schedule and
      returns the step's mean loss); without ``loss_fn``, a SpecError naming it.
    * activation checkpointing: each block is wrapped with ``checkpoint_wrapper`` (non-reentrant
      ``torch.utils.checkpoint``; its state-dict keys stay the block's own).

    Args:
        parallelism / activation_checkpointing: default :func:`strategy` (the environment).
        dtype: default ``config().dtype`` (``SFTCTL_DTYPE``).
        loss_fn: the loss of one micro-batch, ``loss_fn(output, target) -> scalar mean``; used
            (and needed) only under pipeline stages.
    Returns:
        the module to call in the training loop (the same object, sharded in place, for FSDP),
        or under pipeline stages the :class:`~sftctl.train.pipeline.Pipeline`.
    Raises:
        ValueError: an unknown parallelism (or a bad environment variable).
        SpecError: a layout the model cannot take, or pipeline stages without ``loss_fn``
            (:func:`sftctl.train.parallel.prepare_layout`).
    """
    import torch
    import torch.distributed as dist

    lay = layout()
    if max(lay.tp, lay.pp, lay.cp, lay.ep) > 1:  # the plan splits more than the data dimension
        _log(f"layout {lay.label}")
        return prepare_layout(model, lay, loss_fn)
    env_par, env_ckpt = strategy()
    par = parallelism or env_par
    if par not in PARALLELISMS:
        raise ValueError(f"parallelism: expected ddp or fsdp, got {par!r}")
    ckpt = env_ckpt if activation_checkpointing is None else activation_checkpointing
    dtype = dtype or config().dtype
    world = dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1
    units = blocks(model)
    if ckpt and units:
        from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import apply_activation_checkpointing

        ids = {id(b) for b in units}
        apply_activation_checkpointing(model, check_fn=lambda m: id(m) in ids)
        units = blocks(model)
        _log(f"activation checkpointing on {len(units)} blocks")
    if par == "fsdp":
        if world == 1 and not (dist.is_available() and dist.is_initialized()):
            _log("fsdp asked but torch.distributed is not initialized: training unsharded")
            return model
        try:
            from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

            low = dtype in ("bfloat16", "float16")
            mp = MixedPrecisionPolicy(param_dtype=getattr(torch, dtype), reduce_dtype=torch.float32) if low \
                else MixedPrecisionPolicy()
            for b in units:
                fully_shard(b, mp_policy=mp)
            fully_shard(model, mp_policy=mp)
            _log(f"fsdp: {len(units)} blocks + root sharded over {world} ranks"
                 + (f", parameters in {dtype}, gradients reduced in float32" if low else ""))
            return model
        except Exception as e:  # noqa: BLE001 - say why, then run what surely works
            _log(f"fsdp failed ({type(e).__name__}: {e}); falling back to ddp")
            par = "ddp"
    if world > 1:
        from torch.nn.parallel import DistributedDataParallel

        dev = next((p.device for p in model.parameters()), torch.device("cpu"))
        _log(f"ddp over {world} ranks")
        # gradients are views into DDP's all-reduce buckets: no second copy of them, as the
        # planner's memory for ddp assumes (sftctl.compiler.sharding)
        return DistributedDataParallel(model, device_ids=[dev.index] if dev.type == "cuda" else None,
                                       gradient_as_bucket_view=True)
    return model


def _dist():
    import torch.distributed as dist

    return dist if dist.is_available() and dist.is_initialized() else None


def _broadcast(value: Any) -> Any:
    dist = _dist()
    if dist is None:
        return value
    box = [value]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def _all_gather(value: Any) -> list:
    dist = _dist()
    if dist is None:
        return [value]
    out = [None] * dist.get_world_size()
    dist.all_gather_object(out, value)
    return out


def save_sharded_checkpoint(model: Any, optimizer: Any, step: int, *, extra: dict | None = None,
                            keep: int | None = None) -> Path:
    """Every rank writes its own shards of ``model`` and ``optimizer`` with
    ``torch.distributed.checkpoint`` (DCP); call it on every rank at once (it is collective).

    Works for a plain module, DDP and FSDP2 alike (``get_state_dict`` gives each rank its local
    shards under the model's own parameter names). Order, so a torn checkpoint is never resumed:

    1. rank 0 makes ``<checkpoint_dir>/step-%08d.tmp-<pid>`` and tells the others its name; a rank
       that does not see it (another node's disk) makes its own.
    2. ``dcp.save`` into it: each rank its ``__<rank>_0.distcp``, then rank 0 the ``.metadata``.
    3. With ``$SFTCTL_STORAGE_URL``: rank 0 deletes the step's manifest, every rank uploads the
       files it wrote, rank 0 writes ``MANIFEST.json`` listing all of them last and prunes the
       storage to ``keep`` (:func:`sftctl.storage.checkpoints.write_manifest`).
    4. rank 0 writes ``COMPLETE`` (``{"step", "format": "dcp", "world_size"}``), fsyncs and
       renames the directory to ``step-%08d``, and prunes to ``keep``. A rank on another disk
       removes its partial directory once its files are in job storage.

    Args:
        extra: small picklable values saved with the checkpoint (an RNG state, a data offset).
        keep: as :func:`save_checkpoint`.
    Returns:
        the final local directory (rank 0's view; other ranks get the same path).
    Raises:
        ValueError: a negative step or bad keep. OSError / StorageError: a write failed (no
            rank finalizes: the step stays incomplete everywhere).
    """
    keep = _checkpoint_args(step, keep)
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict

    dist = _dist()
    rank = dist.get_rank() if dist else 0
    world = dist.get_world_size() if dist else 1
    root = checkpoint_dir()
    name = _step_name(step)
    final = root / name
    tmp_name = f"{name}.tmp-{os.getpid()}"
    if rank == 0:
        root.mkdir(parents=True, exist_ok=True)
        if (root / tmp_name).exists():
            shutil.rmtree(root / tmp_name)
        (root / tmp_name).mkdir()
    tmp_name = _broadcast(tmp_name)
    tmp = root / tmp_name
    own_disk = rank != 0 and not tmp.exists()
    if own_disk:  # another node's disk: our files go to our own copy of the directory
        tmp.mkdir(parents=True, exist_ok=True)
    # optimizer state and param groups keyed by parameter name (torchtitan does the same): each
    # pipeline stage holds other parameters in its one param group, so list-indexed groups of two
    # stages collide in the checkpoint and do not reshard onto another set of stages
    model_sd, optim_sd = get_state_dict(model, optimizer, options=StateDictOptions(flatten_optimizer_state_dict=True))
    try:
        dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=str(tmp))
        if rank == 0:
            import torch

            with open(tmp / EXTRA_FILE, "wb") as fh:
                torch.save({"step": int(step), **dict(extra or {})}, fh)
                fh.flush()
                os.fsync(fh.fileno())
    except (OSError, RuntimeError) as exc:
        full = _space_error(exc, step, tmp, final)
        if full is not None:
            raise full from exc
        raise
    storage = _job_storage()
    if storage is not None:
        if rank == 0:
            begin_checkpoint(storage, step)
        if dist:
            dist.barrier()
        mine = {f.name: f for f in tmp.iterdir() if f.is_file() and (
            f.name.startswith(f"__{rank}_") or (rank == 0 and f.name in (DCP_METADATA, EXTRA_FILE)))}
        files = upload_files(storage, step, mine) if mine else []
        parts = _all_gather(files)
        if rank == 0:
            write_manifest(storage, step, [f for part in parts for f in part], keep=keep)
    if dist:
        dist.barrier()
    if rank == 0:
        with open(tmp / COMPLETE_FILE, "w", encoding="utf-8") as fh:
            json.dump({"step": int(step), "format": "dcp", "world_size": world}, fh)
            fh.flush()
            os.fsync(fh.fileno())
        _fsync_dir(tmp)
        if final.exists():
            shutil.rmtree(final)
        os.rename(tmp, final)
        _fsync_dir(root)
        _prune(root, keep)
    if own_disk and storage is not None:
        shutil.rmtree(tmp, ignore_errors=True)
    if dist:
        dist.barrier()
    _preflight.at_checkpoint(step)  # a long job's periodic check of this rank's device (issue 41)
    return final


def _whole(path: Path) -> bool:
    """Whether the checkpoint directory ``path`` holds every file it needs: each shard its DCP
    ``.metadata`` names, or the single-file ``state.pt``."""
    if not path.is_dir():
        return False
    if (path / DCP_METADATA).is_file():
        import torch.distributed.checkpoint as dcp

        metadata = dcp.FileSystemReader(str(path)).read_metadata()
        return all((path / s.relative_path).is_file() for s in (metadata.storage_data or {}).values())
    return (path / STATE_FILE).is_file()


def load_sharded_checkpoint(model: Any, optimizer: Any) -> tuple[int, dict] | None:
    """Load the newest complete checkpoint (a DCP one, or a single-file ``state.pt`` one
    written by :func:`save_checkpoint` with ``{"model", "optimizer"}``) into ``model`` and
    ``optimizer`` as they are wrapped now, on every rank at once (collective). DCP reshards: the
    checkpoint may come from another number of ranks or another strategy.

    Rank 0 finds the checkpoint (:func:`latest_checkpoint`: local, or downloaded from job
    storage); a rank that cannot see that directory (another node's disk) downloads it from
    job storage too.

    Returns:
        ``(step, extra)`` (``extra`` as given to :func:`save_sharded_checkpoint`), or None when
        there is no complete checkpoint.
    Raises:
        FileNotFoundError: a rank cannot see the checkpoint and there is no job storage.
    """
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict, set_state_dict

    dist = _dist()
    rank = dist.get_rank() if dist else 0
    found = latest_checkpoint() if rank == 0 else None
    found = _broadcast(None if found is None else (str(found), _read_complete(found)))
    if found is None:
        return None
    found_path, step = Path(found[0]), int(found[1])
    # this node's copy first, then rank 0's where this node sees it (a shared or the same disk);
    # a copy is whole only with every shard its .metadata names: each node's directory holds the
    # shards its own ranks wrote, so rank 0's may lack the others'
    path = next((p for p in (checkpoint_dir() / found_path.name, found_path) if _whole(p)), None)
    if path is None:
        storage = _job_storage()
        if storage is None:
            raise FileNotFoundError(f"rank {rank}: checkpoint {found_path} is not whole on this node's disk "
                                    "and there is no job storage")
        if int(os.environ.get("LOCAL_RANK", "0")) == 0:
            _download_checkpoint(storage, step, checkpoint_dir())
        path = checkpoint_dir() / found_path.name
    if dist:
        dist.barrier()
    if (path / DCP_METADATA).is_file():
        import torch

        # a checkpoint written before optimizer state was keyed by parameter name keeps its
        # list-indexed param groups ("optim.param_groups.0.lr"): read it as it was written
        keys = dcp.FileSystemReader(str(path)).read_metadata().state_dict_metadata
        options = StateDictOptions(flatten_optimizer_state_dict="optim.param_groups.0.params" not in keys)
        model_sd, optim_sd = get_state_dict(model, optimizer, options=options)
        state = {"model": model_sd, "optim": optim_sd}
        dcp.load(state, checkpoint_id=str(path))
        set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"],
                       options=options)
        extra = torch.load(path / EXTRA_FILE, map_location="cpu", weights_only=True)
        extra.pop("step", None)
    else:  # a single-file checkpoint: full state dicts, every rank takes its part
        import torch

        full = torch.load(path / STATE_FILE, map_location="cpu", weights_only=True)
        set_state_dict(model, optimizer, model_state_dict=full["model"], optim_state_dict=full["optimizer"],
                       options=StateDictOptions(full_state_dict=True))
        extra = {k: v for k, v in full.items() if k not in ("model", "optimizer")}
    if dist:
        dist.barrier()
    return step, extra
