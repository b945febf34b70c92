"""Ship the job's workdir to its nodes through job storage, as one content-addressed tar.gz.

``upload_workdir(storage, path)`` packs the directory and stores it as
``workdir/<sha256 of the archive>.tar.gz``; a node calls ``fetch_workdir(storage, key, dest)``.

What is packed: every regular file and symlink below the directory, except

* ``.git`` (a directory, or the file a worktree has), always;
* what ``.gitignore`` files ignore (git's syntax and semantics: a file in a subdirectory applies
  below it, deeper files and later lines win, ``!`` re-includes, a directory that is ignored is
  not descended into);
* what ``.sftctlignore`` files ignore: the same syntax, read after the ``.gitignore`` of the same
  directory, so it can also re-include (``!data/small.csv``) what git ignores.

The archive is deterministic: members sorted by path, mtimes 0, uid/gid 0 with empty owner names,
modes normalized to 0644 / 0755 (executable), a gzip header with no name and no time. The same
content gives the same bytes, so the same key, and ``upload_workdir`` uploads nothing when that
key already exists.
"""

from __future__ import annotations

import dataclasses
import gzip
import hashlib
import io
import os
import stat
import tarfile
from pathlib import Path
from typing import Any

from sftctl.errors import SpecError
from sftctl.storage import Storage, StorageError

__all__ = [
    "DEFAULT_MAX_BYTES",
    "IGNORE_FILES",
    "PackedWorkdir",
    "WorkdirTooLargeError",
    "check_workdir_size",
    "fetch_workdir",
    "list_workdir",
    "pack_workdir",
    "upload_workdir",
    "workdir_key",
]

#: Default limit on the workdir's packed files, uncompressed (100 MiB: the spec's
#: ``storage.max_workdir_mb`` default, which counts MiB).
DEFAULT_MAX_BYTES = 100 * 2**20
#: Ignore files read in every directory, in this order (later wins).
IGNORE_FILES = (".gitignore", ".sftctlignore")
#: Names never packed.
ALWAYS_SKIPPED = (".git",)
KEY_PREFIX = "workdir/"


class WorkdirTooLargeError(SpecError):
    """The workdir's files add up to more than the limit. Exit code 2.

    ``biggest`` lists ``(relative path, bytes)`` of the largest files, biggest first.
    """

    def __init__(self, message: str, hint: str | None = None, biggest: list | None = None):
        super().__init__(message, hint)
        self.biggest = biggest or []


@dataclasses.dataclass(frozen=True)
class PackedWorkdir:
    """A packed workdir.

    Attributes:
        data: the tar.gz archive's bytes.
        sha256: hex sha256 of ``data``.
        key: its storage key, ``workdir/<sha256>.tar.gz``.
        files: how many members (files and symlinks) it holds.
        size_bytes: the members' total size, uncompressed.
        uploaded: whether ``upload_workdir`` wrote it (False: the key was already there).
    """

    data: bytes
    sha256: str
    key: str
    files: int
    size_bytes: int
    uploaded: bool = False


def workdir_key(sha256: str) -> str:
    """The storage key of the archive with this sha256: ``workdir/<sha256>.tar.gz``."""
    return f"{KEY_PREFIX}{sha256}.tar.gz"


def _load_spec(directory: Path):
    """The pathspec of the ignore files in ``directory``, or None when it has none."""
    lines: list[str] = []
    for name in IGNORE_FILES:
        path = directory / name
        if path.is_file():
            lines += path.read_text(encoding="utf-8", errors="replace").splitlines()
    if not lines:
        return None
    import pathspec

    return pathspec.GitIgnoreSpec.from_lines(lines)


def _ignored(specs: list[tuple[str, Any]], rel: str, is_dir: bool) -> bool:
    """Whether ``rel`` (relative to the workdir) is ignored by the stack of ``(base, spec)``,
    evaluated like git: the deepest ignore file with a matching pattern decides."""
    verdict = False
    for base, spec in specs:
        sub = rel[len(base):] if base else rel
        result = spec.check_file(sub + "/" if is_dir else sub)
        if result.include is not None:
            verdict = result.include
    return verdict


def list_workdir(root: str | os.PathLike) -> list[tuple[str, Path, os.stat_result]]:
    """The files a pack of ``root`` holds: ``[(relative posix path, absolute path, lstat)]``,
    sorted by relative path (byte order). Regular files and symlinks only.

    Raises:
        SpecError: ``root`` is not a directory.
    """
    root = Path(root)
    if not root.is_dir():
        raise SpecError(f"workdir {root} is not a directory", hint="set workdir to a directory in the job spec")
    out = []
    spec_stack: list[tuple[str, object]] = []

    def walk(directory: Path, rel_dir: str, specs: list) -> None:
        spec = _load_spec(directory)
        if spec is not None:
            specs = specs + [(rel_dir, spec)]
        try:
            entries = sorted(os.scandir(directory), key=lambda e: e.name.encode("utf-8", "surrogateescape"))
        except PermissionError as e:
            raise SpecError(f"workdir: cannot read {e.filename}", hint="fix its permissions or add it to .sftctlignore") from None
        for entry in entries:
            if entry.name in ALWAYS_SKIPPED:
                continue
            rel = rel_dir + entry.name
            st = entry.stat(follow_symlinks=False)
            if stat.S_ISDIR(st.st_mode):
                if not _ignored(specs, rel, True):
                    walk(Path(entry.path), rel + "/", specs)
            elif stat.S_ISREG(st.st_mode) or stat.S_ISLNK(st.st_mode):
                if not _ignored(specs, rel, False):
                    out.append((rel, Path(entry.path), st))

    walk(root, "", spec_stack)
    out.sort(key=lambda t: t[0].encode("utf-8", "surrogateescape"))
    return out


def _fmt_mib(n: int) -> str:
    return f"{n / 2**20:.1f} MiB"


def check_workdir_size(root: str | os.PathLike, *, max_bytes: int = DEFAULT_MAX_BYTES,
                       files: list[tuple[str, Path, os.stat_result]] | None = None) -> int:
    """The bytes the files a pack of ``root`` would hold add up to, uncompressed; nothing is
    read but the directory tree (``sftctl run`` and ``--dry-run`` check this before the job is
    recorded, instead of failing at LAUNCHING).

    Raises:
        WorkdirTooLargeError: more than ``max_bytes``: the message (in MiB, as
            ``storage.max_workdir_mb``) names the five biggest files, the hint ``.sftctlignore``
            and ``storage.max_workdir_mb``.
        SpecError: ``root`` is not a directory, or a directory cannot be read.
    """
    files = list_workdir(root) if files is None else files
    total = sum(st.st_size for _, _, st in files if stat.S_ISREG(st.st_mode))
    if total > max_bytes:
        biggest = sorted(((rel, st.st_size) for rel, _, st in files if stat.S_ISREG(st.st_mode)),
                         key=lambda t: (-t[1], t[0]))[:5]
        names = ", ".join(f"{rel} ({_fmt_mib(size)})" for rel, size in biggest)
        raise WorkdirTooLargeError(
            f"workdir {root} is {_fmt_mib(total)}, over the {_fmt_mib(max_bytes)} limit; biggest: {names}",
            hint="list what the nodes do not need in .sftctlignore (gitignore syntax, e.g. 'data/' or '*.pt'), "
                 f"or raise storage.max_workdir_mb (now {max_bytes / 2**20:g}, in MiB)",
            biggest=biggest,
        )
    return total


def pack_workdir(root: str | os.PathLike, *, max_bytes: int = DEFAULT_MAX_BYTES) -> PackedWorkdir:
    """Pack ``root`` into a deterministic tar.gz (see the module docstring for what is packed).

    Args:
        root: the workdir.
        max_bytes: the most the packed files may add up to, uncompressed, in bytes.

    Raises:
        WorkdirTooLargeError: the files add up to more than ``max_bytes`` (:func:`check_workdir_size`).
        SpecError: ``root`` is not a directory, or a file cannot be read.
    """
    files = list_workdir(root)
    total = check_workdir_size(root, max_bytes=max_bytes, files=files)
    raw = io.BytesIO()
    # gzip header: no file name, mtime 0 (tarfile's "w:gz" would record both)
    with gzip.GzipFile(filename="", mode="wb", fileobj=raw, mtime=0, compresslevel=6) as gz:
        with tarfile.open(fileobj=gz, mode="w", format=tarfile.PAX_FORMAT) as tar:
            for rel, path, st in files:
                info = tarfile.TarInfo(rel)
                info.mtime, info.uid, info.gid, info.uname, info.gname = 0, 0, 0, "", ""
                if stat.S_ISLNK(st.st_mode):
                    link = os.readlink(path)
                    inside = os.path.normpath(os.path.join(os.path.dirname(rel), link))
                    if os.path.isabs(link) or inside == ".." or inside.startswith("../"):
                        raise SpecError(f"workdir: {rel} is a symlink to {link}, outside the workdir",
                                        hint="add it to .sftctlignore, or copy what it points to into the workdir")
                    info.type, info.mode, info.linkname = tarfile.SYMTYPE, 0o777, link
                    tar.addfile(info)
                    continue
                info.mode = 0o755 if st.st_mode & 0o111 else 0o644
                try:
                    with open(path, "rb") as fh:
                        info.size = os.fstat(fh.fileno()).st_size
                        tar.addfile(info, fh)
                except OSError as e:
                    raise SpecError(f"workdir: cannot read {rel}: {e.strerror}",
                                    hint="fix its permissions or add it to .sftctlignore") from None
    data = raw.getvalue()
    sha = hashlib.sha256(data).hexdigest()
    return PackedWorkdir(data, sha, workdir_key(sha), len(files), total)


def upload_workdir(storage: Storage, root: str | os.PathLike, *, max_bytes: int = DEFAULT_MAX_BYTES) -> PackedWorkdir:
    """Pack ``root`` and store it as ``workdir/<sha256>.tar.gz`` unless that key already exists.

    Returns the :class:`PackedWorkdir` (``uploaded`` says whether bytes were sent). Raises what
    :func:`pack_workdir` raises, and :class:`~sftctl.storage.StorageError` from the storage.
    """
    packed = pack_workdir(root, max_bytes=max_bytes)
    if storage.exists(packed.key):
        return packed
    storage.put_bytes(packed.key, packed.data)
    return dataclasses.replace(packed, uploaded=True)


def fetch_workdir(storage: Storage, key: str, dest: str | os.PathLike) -> Path:
    """Download the archive ``key`` and unpack it into ``dest`` (created; existing files with the
    same names are replaced). Run on a node before the job's ``setup``.

    The archive's sha256 is checked against the key, and members that would land outside
    ``dest`` (absolute paths, ``..``, links pointing out) are refused.

    Returns:
        ``dest`` as a Path.

    Raises:
        StorageNotFound: no such archive.
        StorageError: the archive's content does not match its key, or it holds unsafe members.
    """
    dest = Path(dest)
    data = storage.get_bytes(key)
    name = key.rsplit("/", 1)[-1]
    if name.endswith(".tar.gz") and hashlib.sha256(data).hexdigest() != name[: -len(".tar.gz")]:
        raise StorageError(f"storage {storage.url}: {key} is corrupt (its sha256 does not match its name)",
                           hint="re-run the job so sftctl uploads the workdir again", url=storage.url)
    dest.mkdir(parents=True, exist_ok=True)
    with tarfile.open(fileobj=io.BytesIO(data), mode="r:gz") as tar:
        members = tar.getmembers()
        for m in members:
            _check_member(storage, key, m, dest)
        for m in members:  # a file replaces a stale file or link of the same name
            target = dest / m.name
            if target.is_symlink() or target.is_file():
                target.unlink()
        # the pack holds 0644/0755; on the node the files get this process's umask (owner-only
        # under sftctl), as files it created itself would
        umask = os.umask(0)
        os.umask(umask)
        for m in members:
            m.mode &= ~umask & 0o7777
        if hasattr(tarfile, "data_filter"):
            tar.extractall(dest, filter="data")
        else:  # pragma: no cover - Python without PEP 706's filters; members were checked above
            tar.extractall(dest)
    return dest


def _check_member(storage: Storage, key: str, m: tarfile.TarInfo, dest: Path) -> None:
    root = os.path.realpath(dest)
    target = os.path.realpath(os.path.join(root, m.name))
    bad = m.name.startswith("/") or not (target == root or target.startswith(root + os.sep))
    if m.issym():
        link = os.path.realpath(os.path.join(os.path.dirname(target), m.linkname))
        bad = bad or os.path.isabs(m.linkname) or not link.startswith(root + os.sep)
    elif not (m.isfile() or m.isdir()):
        bad = True
    if bad:
        raise StorageError(f"storage {storage.url}: {key} holds an unsafe member {m.name!r}",
                           hint="sftctl never writes such archives: re-run the job to upload it again",
                           url=storage.url)
