"""Checkpoints in job storage, written so that a torn one is never resumed from.

Layout (keys relative to the storage's prefix)::

    checkpoints/step-00000100/state.pt          data objects (any names, nested allowed)
    checkpoints/step-00000100/COMPLETE
    checkpoints/step-00000100/MANIFEST.json     written LAST: {"format": 1, "step": 100,
                                                "created_at": unix s, "files": [{"name": "state.pt",
                                                "size": bytes, "sha256": hex}, ...]}

Object stores have no rename, so atomicity comes from order: every data object is uploaded
first, the manifest last. A checkpoint counts as *complete* only when its manifest exists, parses,
names this step, and every object it lists exists with the listed size (a writer killed after
the manifest of a rewrite was deleted, or an object deleted by hand, is caught by that check).
Deleting goes the other way: manifest first, then the data, so a half-deleted checkpoint is
incomplete too. sha256 sums are checked when a checkpoint is read (:func:`download_checkpoint`,
:func:`read_file`), not when listing (that would read every byte).

One writer per storage prefix at a time (typically global rank 0).

The same checkpoints in a local directory (what :mod:`sftctl.train` writes on a node, a spec's
``train.checkpoint_dir``)::

    <root>/step-00000100/state.pt        (or a sharded checkpoint's DCP files with .metadata)
    <root>/step-00000100/COMPLETE        {"step": 100, ...}, written and fsynced last
    <root>/step-00000100.tmp-<pid>/      being written (never counted)

:func:`complete_checkpoint_steps` counts complete ones in either place: the controller uses it
(it never imports the training helper) and so does :mod:`sftctl.train`.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import hashlib
import json
import os
import re
import time
from pathlib import Path
from typing import Mapping, Union

from sftctl.storage import Storage, StorageError, StorageNotFound, _check_key, open_storage

__all__ = [
    "MANIFEST",
    "CheckpointFile",
    "Manifest",
    "complete_steps",
    "delete_checkpoint",
    "download_checkpoint",
    "latest_complete",
    "prune",
    "read_file",
    "read_manifest",
    "step_prefix",
    "begin_checkpoint",
    "complete_checkpoint_steps",
    "complete_local_checkpoints",
    "read_complete_marker",
    "upload_files",
    "write_checkpoint",
    "write_manifest",
]

PREFIX = "checkpoints/"
MANIFEST = "MANIFEST.json"
_STEP_RE = re.compile(r"^checkpoints/step-(\d{8,})/(.+)$")
_HASH_CHUNK = 8 * 1024 * 1024

# ---- a local checkpoint directory (sftctl.train's layout)
#: A full-state checkpoint's one data file.
STATE_FILE = "state.pt"
#: torch.distributed.checkpoint's index, written by rank 0 after every shard of a sharded one.
DCP_METADATA = ".metadata"
#: The marker written and fsynced last: ``{"step": N, ...}``.
COMPLETE_FILE = "COMPLETE"
# Final checkpoint dirs: "step-" + the step zero padded to 8 digits ("%08d" grows past 8 digits
# for steps >= 10**8, hence {8,}).
FINAL_DIR_RE = re.compile(r"^step-(\d{8,})$")

#: A checkpoint's content: ``{name: bytes | path of a file}``, or a directory (every file below it).
CheckpointData = Union[Mapping[str, Union[bytes, str, os.PathLike]], str, os.PathLike]


@dataclasses.dataclass(frozen=True)
class CheckpointFile:
    """One object of a checkpoint: ``name`` relative to the step's prefix, ``size`` in bytes, ``sha256`` hex."""

    name: str
    size: int
    sha256: str


@dataclasses.dataclass(frozen=True)
class Manifest:
    """A checkpoint's manifest: its ``step``, ``files`` and ``created_at`` (unix s)."""

    step: int
    files: tuple[CheckpointFile, ...]
    created_at: float = 0.0

    def to_json(self) -> bytes:
        return json.dumps({"format": 1, "step": self.step, "created_at": self.created_at,
                           "files": [dataclasses.asdict(f) for f in self.files]}, indent=1).encode()

    @classmethod
    def from_json(cls, data: bytes) -> "Manifest":
        """Parse a manifest. Raises ValueError when it is malformed."""
        try:
            raw = json.loads(data)
            files = tuple(CheckpointFile(str(f["name"]), int(f["size"]), str(f["sha256"])) for f in raw["files"])
            return cls(int(raw["step"]), files, float(raw.get("created_at", 0.0)))
        except (KeyError, TypeError, AttributeError) as e:
            raise ValueError(f"malformed checkpoint manifest: {e}") from None

    @property
    def size_bytes(self) -> int:
        return sum(f.size for f in self.files)


def step_prefix(step: int) -> str:
    """The key prefix of the checkpoint of ``step``: ``checkpoints/step-%08d/``."""
    if step < 0:
        raise ValueError(f"step must be >= 0, got {step}")
    return f"{PREFIX}step-{step:08d}/"


def _sha256_file(path: str | os.PathLike) -> tuple[int, str]:
    h = hashlib.sha256()
    n = 0
    with open(path, "rb") as fh:
        while chunk := fh.read(_HASH_CHUNK):
            h.update(chunk)
            n += len(chunk)
    return n, h.hexdigest()


def _collect(data: CheckpointData) -> dict[str, bytes | Path]:
    """The checkpoint's ``{name: bytes | Path}``, names validated as keys."""
    if isinstance(data, (str, os.PathLike)):
        root = Path(data)
        if not root.is_dir():
            raise ValueError(f"checkpoint directory {root} does not exist")
        items: dict[str, bytes | Path] = {p.relative_to(root).as_posix(): p for p in sorted(root.rglob("*")) if p.is_file()}
    else:
        items = {name: (value if isinstance(value, (bytes, bytearray, memoryview)) else Path(value))
                 for name, value in data.items()}
    for name in items:
        _check_key(name)
        if name == MANIFEST:
            raise ValueError(f"a checkpoint file may not be named {MANIFEST}")
    if not items:
        raise ValueError("a checkpoint needs at least one file")
    return items


def _upload(storage: Storage, prefix: str, items: dict[str, bytes | Path], workers: int) -> list[CheckpointFile]:
    """Upload ``items`` (from :func:`_collect`) under ``prefix``, ``workers`` at a time; their
    :class:`CheckpointFile` records in name order."""

    def upload(name: str) -> CheckpointFile:
        value = items[name]
        if isinstance(value, Path):
            size, sha = _sha256_file(value)
            storage.upload_file(prefix + name, value)
        else:
            value = bytes(value)
            size, sha = len(value), hashlib.sha256(value).hexdigest()
            storage.put_bytes(prefix + name, value)
        return CheckpointFile(name, size, sha)

    names = sorted(items)
    if workers > 1 and len(names) > 1:
        with concurrent.futures.ThreadPoolExecutor(min(workers, len(names))) as pool:
            return list(pool.map(upload, names))
    return [upload(name) for name in names]


def write_checkpoint(storage: Storage, step: int, data: CheckpointData, *, keep: int | None = 3,
                     workers: int = 4) -> Manifest:
    """Write the checkpoint of ``step``: data objects first, ``MANIFEST.json`` last; then prune.

    An existing checkpoint of the same step (complete or torn) is replaced: its manifest is
    deleted first, so from that moment until the new manifest lands the step is incomplete and
    :func:`latest_complete` returns the previous one.

    Args:
        storage: the job's storage.
        step: the training step; >= 0.
        data: ``{name: bytes | file path}`` (names are relative keys such as ``state.pt`` or
            ``shards/rank-0.pt``), or a directory whose files are all uploaded.
        keep: keep this many newest complete checkpoints, counting this one (older ones are
            deleted, and torn ones older than this step); None keeps everything.
        workers: files uploaded in parallel (each big file is also uploaded in parallel parts).

    Returns:
        The manifest written.

    Raises:
        ValueError: a bad step, ``keep`` < 1, no files, or a bad file name.
        StorageError: an upload failed; the step stays incomplete and earlier checkpoints stay.
        OSError: a source file cannot be read.
    """
    if keep is not None and keep < 1:
        raise ValueError(f"keep must be >= 1, got {keep}")
    prefix = step_prefix(step)
    items = _collect(data)
    storage.delete(prefix + MANIFEST)
    stale = {key for key, _ in storage.list(prefix)}
    files = _upload(storage, prefix, items, workers)
    for key in sorted(stale - {prefix + f.name for f in files}):  # leftovers of a torn earlier write
        storage.delete(key)
    manifest = Manifest(int(step), tuple(files), time.time())
    storage.put_bytes(prefix + MANIFEST, manifest.to_json())
    if keep is not None:
        prune(storage, keep)
    return manifest


def upload_files(storage: Storage, step: int, data: CheckpointData, *, workers: int = 4) -> list[CheckpointFile]:
    """Upload some of a checkpoint's data objects (no manifest): one writer's part of a
    checkpoint that several processes write (each rank its own DCP shard files). The checkpoint
    stays incomplete until :func:`write_manifest` lists every part.

    Raises:
        ValueError: no files, or a bad file name. StorageError: an upload failed.
    """
    prefix = step_prefix(step)
    return _upload(storage, prefix, _collect(data), workers)


def begin_checkpoint(storage: Storage, step: int) -> None:
    """Before several writers upload the parts of ``step``: delete its manifest (a rewrite of
    the step is incomplete from now until :func:`write_manifest`)."""
    storage.delete(step_prefix(step) + MANIFEST)


def write_manifest(storage: Storage, step: int, files: list[CheckpointFile], *, keep: int | None = 3) -> Manifest:
    """Make a checkpoint uploaded in parts (:func:`upload_files`) complete: check every listed
    object is there with its size, delete objects of a torn earlier write that are not listed,
    write ``MANIFEST.json`` last, then prune to ``keep``.

    Raises:
        StorageError: a listed object is missing or has another size (the step stays incomplete).
    """
    if keep is not None and keep < 1:
        raise ValueError(f"keep must be >= 1, got {keep}")
    prefix = step_prefix(step)
    present = dict(storage.list(prefix))
    for f in files:
        if present.get(prefix + f.name) != f.size:
            raise StorageError(f"checkpoint {step}: {f.name} is not in {storage.url} with {f.size} bytes")
    for key in sorted(set(present) - {prefix + f.name for f in files} - {prefix + MANIFEST}):
        storage.delete(key)
    manifest = Manifest(int(step), tuple(sorted(files, key=lambda f: f.name)), time.time())
    storage.put_bytes(prefix + MANIFEST, manifest.to_json())
    if keep is not None:
        prune(storage, keep)
    return manifest


def read_manifest(storage: Storage, step: int) -> Manifest | None:
    """The manifest of ``step``, or None when it is missing or malformed (no completeness check)."""
    try:
        manifest = Manifest.from_json(storage.get_bytes(step_prefix(step) + MANIFEST))
    except (StorageNotFound, ValueError):
        return None
    return manifest if manifest.step == step else None


def _scan(storage: Storage) -> dict[int, dict[str, int]]:
    """``{step: {name: size}}`` of every object under ``checkpoints/`` (one listing)."""
    steps: dict[int, dict[str, int]] = {}
    for key, size in storage.list(PREFIX):
        m = _STEP_RE.match(key)
        if m:
            steps.setdefault(int(m.group(1)), {})[m.group(2)] = size
    return steps


def _is_complete(storage: Storage, step: int, objects: dict[str, int]) -> bool:
    if MANIFEST not in objects:
        return False
    manifest = read_manifest(storage, step)
    return manifest is not None and all(objects.get(f.name) == f.size for f in manifest.files)


def complete_steps(storage: Storage) -> list[int]:
    """The steps of every complete checkpoint, oldest first (reads each candidate's manifest)."""
    return [step for step, objects in sorted(_scan(storage).items()) if _is_complete(storage, step, objects)]


def latest_complete(storage: Storage) -> int | None:
    """The newest step whose checkpoint is complete (see the module docstring), or None.

    A torn checkpoint (no manifest, a malformed one, or a listed object missing or of another
    size) is skipped and the next older one is considered.
    """
    for step, objects in sorted(_scan(storage).items(), reverse=True):
        if _is_complete(storage, step, objects):
            return step
    return None


def delete_checkpoint(storage: Storage, step: int) -> int:
    """Delete the checkpoint of ``step``: manifest first, then its data. Returns objects deleted."""
    prefix = step_prefix(step)
    had_manifest = storage.exists(prefix + MANIFEST)
    storage.delete(prefix + MANIFEST)
    return storage.delete_prefix(prefix) + int(had_manifest)


def prune(storage: Storage, keep: int) -> list[int]:
    """Keep the newest ``keep`` complete checkpoints; delete older complete ones, and torn ones
    older than the newest complete one (left by killed writers). Torn checkpoints newer than
    that are left alone: one may be being written. Returns the steps deleted."""
    if keep < 1:
        raise ValueError(f"keep must be >= 1, got {keep}")
    scanned = _scan(storage)
    complete = [s for s, objects in sorted(scanned.items()) if _is_complete(storage, s, objects)]
    if not complete:
        return []
    doomed = set(complete[:-keep]) | {s for s in scanned if s not in complete and s < complete[-1]}
    for step in sorted(doomed):
        delete_checkpoint(storage, step)
    return sorted(doomed)


def _need_manifest(storage: Storage, step: int) -> Manifest:
    manifest = read_manifest(storage, step)
    if manifest is None:
        raise StorageNotFound(f"storage {storage.url}: no complete checkpoint of step {step}",
                              hint="sftctl.storage.checkpoints.complete_steps() lists those there are",
                              url=storage.url, key=step_prefix(step) + MANIFEST)
    return manifest


def read_file(storage: Storage, step: int, name: str, *, verify: bool = True) -> bytes:
    """The bytes of file ``name`` of the checkpoint of ``step``, sha256-checked when ``verify``.

    Raises:
        StorageNotFound: the step has no manifest or lists no such file.
        StorageError: the object's sha256 does not match the manifest.
    """
    manifest = _need_manifest(storage, step)
    entry = next((f for f in manifest.files if f.name == name), None)
    if entry is None:
        raise StorageNotFound(f"storage {storage.url}: checkpoint {step} has no file {name}",
                              url=storage.url, key=step_prefix(step) + name)
    data = storage.get_bytes(step_prefix(step) + name)
    if verify and hashlib.sha256(data).hexdigest() != entry.sha256:
        raise _corrupt(storage, step, name)
    return data


def _corrupt(storage: Storage, step: int, name: str) -> StorageError:
    return StorageError(f"storage {storage.url}: checkpoint {step}: {name} does not match its manifest's sha256",
                        hint=f"delete the checkpoint (sftctl.storage.checkpoints.delete_checkpoint(storage, {step})) "
                             "to resume from the one before", url=storage.url)


def download_checkpoint(storage: Storage, step: int, dest: str | os.PathLike, *, verify: bool = True,
                        workers: int = 4) -> Manifest:
    """Download every file of the checkpoint of ``step`` into the directory ``dest`` (created),
    each sha256-checked against the manifest when ``verify``. Returns the manifest.

    Raises:
        StorageNotFound: the step has no manifest, or a listed object is missing or of another
            size (the checkpoint is incomplete).
        StorageError: a file's sha256 does not match (it is removed from ``dest``).
    """
    manifest = _need_manifest(storage, step)
    dest = Path(dest)
    prefix = step_prefix(step)
    there = {key[len(prefix):]: size for key, size in storage.list(prefix)}
    missing = [f.name for f in manifest.files if there.get(f.name) != f.size]
    if missing:
        raise StorageNotFound(f"storage {storage.url}: checkpoint {step} is incomplete: "
                              f"{', '.join(missing[:3])} missing or of another size",
                              hint="resume from an earlier checkpoint (latest_complete)",
                              url=storage.url, key=prefix + missing[0])

    def fetch(entry: CheckpointFile) -> None:
        target = dest.joinpath(*entry.name.split("/"))
        target.parent.mkdir(parents=True, exist_ok=True)
        storage.download_file(prefix + entry.name, target)
        if verify:
            size, sha = _sha256_file(target)
            if (size, sha) != (entry.size, entry.sha256):
                target.unlink()
                raise _corrupt(storage, step, entry.name)

    dest.mkdir(parents=True, exist_ok=True)
    if workers > 1 and len(manifest.files) > 1:
        with concurrent.futures.ThreadPoolExecutor(min(workers, len(manifest.files))) as pool:
            list(pool.map(fetch, manifest.files))
    else:
        for entry in manifest.files:
            fetch(entry)
    return manifest


# --------------------------------------------------------------------------------------------
# local checkpoint directories (sftctl.train's layout) and either kind by root
# --------------------------------------------------------------------------------------------


#: the most bytes of a ``COMPLETE`` marker read (it is a line of JSON)
COMPLETE_MAX_BYTES = 64 << 10


def read_complete_marker(path: str | os.PathLike) -> int | None:
    """The step in ``path/COMPLETE``, or None if it is missing, unreadable, not a regular file
    (a job's nodes write its checkpoint directory, which the server reads at submit: a FIFO
    there made the read wait forever) or longer than :data:`COMPLETE_MAX_BYTES`."""
    import stat

    try:
        fd = os.open(Path(path) / COMPLETE_FILE, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
        with os.fdopen(fd, "rb") as f:
            if not stat.S_ISREG(os.fstat(f.fileno()).st_mode):
                return None
            raw = f.read(COMPLETE_MAX_BYTES + 1)
        if len(raw) > COMPLETE_MAX_BYTES:
            return None
        data = json.loads(raw.decode("utf-8"))
        return int(data["step"])
    except (OSError, ValueError, KeyError, TypeError):
        return None


def complete_local_checkpoints(root: str | os.PathLike[str]) -> list[tuple[int, Path]]:
    """Complete checkpoints in the local directory ``root`` as ``(step, path)``, oldest first:
    a ``step-%08d`` directory whose ``COMPLETE`` names its step and that holds ``state.pt`` or a
    DCP ``.metadata``. A missing ``root`` has none."""
    try:
        entries = list(os.scandir(root))
    except FileNotFoundError:
        return []
    found = []
    for entry in entries:
        match = FINAL_DIR_RE.match(entry.name)
        if not match or not entry.is_dir(follow_symlinks=False):
            continue
        path = Path(entry.path)
        step = int(match.group(1))
        if read_complete_marker(path) == step and ((path / STATE_FILE).is_file() or (path / DCP_METADATA).is_file()):
            found.append((step, path))
    found.sort()
    return found


def complete_checkpoint_steps(root: str | os.PathLike) -> list[int]:
    """The steps of the complete checkpoints under ``root``, oldest first (what a resume sees).

    ``root`` is a local directory (:func:`complete_local_checkpoints`), or a job storage URL
    (``s3://``, ``gs://``, ``file://``, ``pvc://``): then the steps whose ``MANIFEST.json`` and
    listed objects are all there (:func:`complete_steps`).

    Raises:
        StorageError: the storage URL is bad or the storage unreachable.
    """
    if isinstance(root, str) and "://" in root:
        return complete_steps(open_storage(root))
    return [step for step, _ in complete_local_checkpoints(root)]
