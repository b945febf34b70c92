"""The sandbox a server's local nodes run in (issue 40): a user's job never acts as the server.

Without it a job placed on ``sftctl server``'s own machine (the local provider) runs as the
server's uid, with its ``$SFTCTL_HOME`` (state.db: every token's hash, every user's jobs and
logs), its config and credentials and ``sftctl`` with admin rights in reach. With
``SFTCTL_NODE_SANDBOX=bwrap`` (what :func:`sftctl.server.serve` sets for the controllers it starts,
unless an admin set ``off``) each node's command runs under bubblewrap (``bwrap``), inside the
node's guard (:func:`sftctl.procs.guard`, which stays outside and still reads the server's
``controller.json``):

- the machine's file system read-only (``--ro-bind / /``), its devices (``--dev-bind /dev /dev``:
  GPUs), a private ``/dev/shm``; its own pid namespace with its own ``/proc`` (it sees no other
  process, so no other process's environment), its own IPC and hostname namespaces, a new session
  (no keystrokes pushed into a terminal), no capabilities (``--cap-drop ALL``: even as root it
  cannot mount, trace, or read files of other service users such as munge's key or Postgres'
  data);
- empty directories (tmpfs) over :func:`hidden_dirs`: the server's ``$SFTCTL_HOME``, its
  ``$HOME`` (config, ``server.env``, cloud credentials, ssh keys), ``$XDG_CONFIG_HOME`` and
  ``$XDG_DATA_HOME``, ``/root``, ``/home``, ``/tmp``, ``/var/tmp``, ``/run`` (the sockets of
  D-Bus, systemd, munge, Docker, Postgres) and ``/etc/sftctl``, all read-only but the
  :data:`SCRATCH` ones; an empty file over the config file and a SQLite state file kept
  elsewhere;
- bound back read-only: the Python prefixes and sftctl's package where a hidden directory or a
  read-write bind covers them (a workdir that is sftctl's checkout leaves its package
  read-only), ``/etc/resolv.conf``'s target under ``/run``; read-write: what the job writes
  (:class:`Binds`: its node directory, its workdir, its checkpoint directory), each refused
  when it is or lies inside the server's home, config or state (:func:`check_bind`); one that
  holds the server's home has it hidden again inside. Each is opened once checked
  (:func:`pin`) and bwrap binds that descriptor (``/proc/self/fd/N``), never the path again: a
  link swapped into the path between the check and the mount leads nowhere else. A job whose ``storage:`` is a directory
  of this machine is refused at launch (the local provider): the controller reads and writes
  there through :class:`sftctl.storage.LocalStorage`, which follows links a node could plant;
- an environment built from nothing (:func:`node_environ`): no ``SFTCTL_STATE_URL``,
  ``SFTCTL_HOME``, ``SFTCTL_CONFIG``, ``SFTCTL_SERVER_URL``, ``SFTCTL_SERVER_TOKEN``, cloud
  credentials or anything else of the server's; only ``PATH``, the locale, the GPU selection variables, the node settings
  declared in :mod:`sftctl.settings`, what the controller built for the node (the job's ``env``
  and secrets) and ``HOME`` in the node's own directory. Values travel in the environment or in
  bwrap's options, never on a command line (any user of the machine reads those: ``ps aux``,
  ``/proc/PID/cmdline``): bwrap reads all its options from an anonymous memory file
  (``--args FD``, :class:`Command`), the node's tags (job, node, home) and the job's ``LD_*`` and
  ``PYTHON*`` variables (:func:`outside_environ`) among them as ``--setenv``, so that the
  sandbox's processes carry them while bwrap and the guard do not (a SIGTERM to the tagged
  processes lets them stop gracefully); each node's own loopback address
  (:func:`loopback_identity`) keeps torchrun's rendezvous working across pid namespaces.

No ``--die-with-parent``: like an unsandboxed node, the sandbox's processes carry the node's
tags, so the guard, ``sftctl down`` and ``down --orphans`` find and stop them; a SIGTERM to the
guard must not SIGKILL them before they shipped their last lines. Nodes share the machine's
network (their rendezvous is on 127.0.0.1), so the server's HTTP port is reachable, without a
token.

``bwrap`` needs to be installed (Debian: ``apt-get install bubblewrap``) and, for a server that is
not root, unprivileged user namespaces. Where it cannot start, a server refuses a local-node job
at submit (:func:`check`, :class:`SandboxUnavailable`, exit 2) unless an admin set
``SFTCTL_NODE_SANDBOX=off`` (unsafe: every user's job then runs as the server). Outside a server
(``sftctl run`` on one's own machine) it is off unless set.
"""

from __future__ import annotations

import os
import shutil
import stat
import subprocess
import sys
import time
from pathlib import Path

from sftctl import settings
from sftctl.errors import ExitCode, ProviderError, SftctlError
from sftctl.paths import job_dir, sftctl_home

#: directories every sandbox hides (those that exist and are not symlinks)
SYSTEM_HIDDEN = ("/root", "/home", "/tmp", "/var/tmp", "/run", "/etc/sftctl")

#: environment variables of the server a node keeps (besides those starting with LC_): the
#: locale, the terminal, and which GPUs and libraries this machine's processes use
KEPT_ENV = ("PATH", "LANG", "LANGUAGE", "TZ", "TERM", "LD_LIBRARY_PATH", "CUDA_VISIBLE_DEVICES",
            "NVIDIA_VISIBLE_DEVICES", "NVIDIA_DRIVER_CAPABILITIES", "HIP_VISIBLE_DEVICES",
            "ROCR_VISIBLE_DEVICES")

#: what the check's result is trusted for (s)
CHECK_TTL_S = 30.0
_checked: dict[str, tuple[float, str | None]] = {}  # bwrap path -> (when, why it cannot start)


class SandboxUnavailable(SftctlError):
    """``SFTCTL_NODE_SANDBOX=bwrap`` (a server's local nodes) but bubblewrap is missing or cannot
    start here. Exit code 2."""

    exit_code = ExitCode.USAGE


def requested() -> bool:
    """True when local nodes run sandboxed: ``SFTCTL_NODE_SANDBOX`` is ``bwrap``.

    Raises:
        SettingError: the variable holds something else than bwrap or off (exit 2).
    """
    return settings.get("SFTCTL_NODE_SANDBOX") == "bwrap"


def bwrap_path() -> str | None:
    """The ``bwrap`` on ``PATH``, else None."""
    return shutil.which("bwrap")


def unavailable() -> str | None:
    """Why a sandbox cannot start here (bwrap missing, or a trial ``bwrap ... true`` failing:
    its last line), else None. The answer is kept for :data:`CHECK_TTL_S` seconds."""
    path = bwrap_path()
    if path is None:
        return "bubblewrap (bwrap) is not installed"
    when, why = _checked.get(path, (0.0, None))
    if time.monotonic() - when < CHECK_TTL_S:
        return why
    try:
        proc = subprocess.run([path, "--ro-bind", "/", "/", "--dev-bind", "/dev", "/dev", "--proc", "/proc",
                               "--unshare-pid", "--unshare-ipc", "--unshare-uts", "--new-session",
                               "--cap-drop", "ALL", "--", "true"],
                              stdin=subprocess.DEVNULL, capture_output=True, timeout=30)
        lines = (proc.stderr or b"").decode(errors="replace").strip().splitlines()
        why = None if proc.returncode == 0 else \
            f"{path} cannot start a sandbox: {lines[-1] if lines else f'exit code {proc.returncode}'}"
    except (OSError, subprocess.TimeoutExpired) as e:
        why = f"{path} cannot start a sandbox: {e}"
    _checked[path] = (time.monotonic(), why)
    return why


def check() -> None:
    """Refuse a local-node job when its nodes must be sandboxed (``SFTCTL_NODE_SANDBOX=bwrap``)
    and bubblewrap cannot start here.

    Raises:
        SandboxUnavailable: one line naming the fix (exit 2).
        SettingError: ``SFTCTL_NODE_SANDBOX`` is malformed (exit 2).
    """
    if not requested():
        return
    why = unavailable()
    if why is not None:
        raise SandboxUnavailable(
            f"local nodes of this server run in a sandbox, but {why}",
            hint="install bubblewrap on the server's machine (apt-get install bubblewrap; a server that is not "
                 "root also needs unprivileged user namespaces), or choose another cloud in resources.clouds; "
                 "an admin may set SFTCTL_NODE_SANDBOX=off (unsafe: every user's job then runs as the server)")


def _real(p: str | os.PathLike) -> Path:
    return Path(os.path.realpath(os.path.expanduser(os.fspath(p))))


def _within(path: Path, root: Path) -> bool:
    return path == root or root in path.parents


def sensitive_paths() -> list[Path]:
    """What no node may see or be given: the server's sftctl home, ``$HOME``, XDG config and data
    directories, its config file and a SQLite state file (with its -wal, -shm and -journal)."""
    out = [_real(sftctl_home())]
    for name in ("HOME", "XDG_CONFIG_HOME", "XDG_DATA_HOME"):
        if os.environ.get(name):
            out.append(_real(os.environ[name]))
    try:
        config = settings.config_path()
    except SftctlError:
        config = None
    if config:
        out.append(_real(config))
    try:
        url = settings.get("SFTCTL_STATE_URL") or ""
    except SftctlError:
        url = ""
    if url and "://" not in url:
        db = _real(url)
        out += [db] + [Path(f"{db}{suffix}") for suffix in ("-wal", "-shm", "-journal")]
    return [p for p in dict.fromkeys(out) if p != Path("/")]


#: hidden directories a node may write in (its own empty tmpfs); every other one is read-only
SCRATCH = ("/tmp", "/var/tmp")


def hidden_dirs() -> list[Path]:
    """Directories the sandbox covers with an empty tmpfs (see the module docstring): the
    system ones of :data:`SYSTEM_HIDDEN` (outermost only), then the sensitive ones
    (:func:`sensitive_paths`; one inside another left out), each with a tmpfs of its own, also
    where it lies inside a system one or a bound directory (a workdir holding ``$SFTCTL_HOME``).
    All are read-only in the sandbox but :data:`SCRATCH`."""
    return _outermost([_real(p) for p in SYSTEM_HIDDEN if os.path.isdir(p) and not os.path.islink(p)]) + \
        _outermost([p for p in sensitive_paths() if p.is_dir()])


def _outermost(paths: list[Path]) -> list[Path]:
    out: list[Path] = []
    for p in sorted(set(paths), key=lambda q: len(q.parts)):
        if p != Path("/") and not any(_within(p, q) for q in out):
            out.append(p)
    return out


def check_bind(path: Path, job_id: str, what: str) -> Path:
    """``path`` (resolved) if a node of ``job_id`` may be given it: not a sensitive path
    (:func:`sensitive_paths`) nor inside one, except the job's own node and checkpoint
    directories inside the server's home; not holding a whole :data:`SYSTEM_HIDDEN` directory
    (``/``, ``/tmp``). One that holds a sensitive path is fine: :func:`wrap` hides that again
    inside it.

    Raises:
        ProviderError: one line naming ``what`` and the path (exit 4).
    """
    real = _real(path)
    own = [_real(job_dir(job_id)) / "nodes", _real(job_dir(job_id)) / "checkpoints"]
    if any(_within(real, o) for o in own):
        return real
    for s in sensitive_paths():
        if _within(real, s):
            raise ProviderError(f"local node sandbox: {what} {real} is the server's or inside the server's {s}; "
                                f"a job cannot be given it",
                                hint=f"choose a {what} outside the server's home, config and state")
    for h in (_real(p) for p in SYSTEM_HIDDEN if os.path.isdir(p)):
        if _within(h, real):  # a directory inside one (a workdir under /tmp) is fine; all of it is not
            raise ProviderError(f"local node sandbox: {what} {real} holds {h}, which a job's nodes do not see",
                                hint=f"choose a {what} of the job's own, below {h} if need be")
    return real


#: system directories no node may write in, even as root (the loader's /etc/ld.so.preload, the
#: binaries and libraries every process of the server runs); a :data:`SCRATCH` one inside is fine
SYSTEM_READ_ONLY = ("/etc", "/usr", "/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32", "/boot", "/var",
                    "/proc", "/sys", "/dev")


def check_writable(real: Path, job_id: str, what: str) -> None:
    """Refuse a read-write bind ``real`` (resolved) that lies inside the Python that runs sftctl
    (its prefixes, its interpreter's directory, sftctl's package: a ``.pth`` or module planted
    there runs in the server's next controller, as the server) or inside a
    :data:`SYSTEM_READ_ONLY` directory (outside :data:`SCRATCH`), but the job's own node and
    checkpoint directories (a server's home may be in /var/lib).

    Raises:
        ProviderError: one line naming ``what`` and the path (exit 4).
    """
    import sftctl

    if any(_within(real, _real(job_dir(job_id)) / d) for d in ("nodes", "checkpoints")):
        return
    runtimes = {_real(p) for p in (sys.prefix, sys.base_prefix, sys.exec_prefix, os.path.dirname(sys.executable),
                                   os.path.dirname(os.path.realpath(sys.executable)), os.path.dirname(sftctl.__file__))}
    inside = next((r for r in sorted(runtimes) if _within(real, r)), None)
    if inside is None and not any(_within(real, _real(p)) for p in SCRATCH):
        inside = next((_real(d) for d in SYSTEM_READ_ONLY if os.path.isdir(d) and _within(real, _real(d))), None)
    if inside is not None:
        raise ProviderError(f"local node sandbox: {what} {real} lies inside {inside}, which a job's nodes may "
                            f"only read (the server runs from there); a job cannot be given it to write",
                            hint=f"choose a {what} of the job's own outside the system's and sftctl's directories")


class Binds:
    """What one node's sandbox gets back: ``rw`` and ``ro`` paths (resolved, existing), each
    pinned by a descriptor (``fds``: path -> an ``O_PATH`` descriptor of the directory or file
    that was checked, :func:`pin`). bwrap binds ``/proc/self/fd/N``, never the path again: a
    link swapped into the path after the check is not followed. :func:`wrap` hands the
    descriptors to the :class:`Command` it returns (:meth:`release`); one not handed on is
    closed by :meth:`close` (or when the object is collected)."""

    def __init__(self):
        self.rw: list[Path] = []
        self.ro: list[Path] = []
        self.fds: dict[Path, int] = {}
        self.released = False

    def add(self, path: str | os.PathLike, job_id: str, what: str, *, writable: bool = True,
            create: bool = False) -> Path:
        """Give the node ``path`` (checked by :func:`check_bind`; made when ``create``; pinned
        by :func:`pin`). Returns the path checked (resolved), also when it does not exist (then
        nothing is given).

        Raises:
            ProviderError: the path is refused, cannot be made or opened, or changed while it
                was checked (exit 4).
        """
        real = check_bind(Path(path), job_id, what)
        if writable:
            check_writable(real, job_id, what)
        if create:
            try:
                real.mkdir(parents=True, exist_ok=True)
            except OSError as e:
                raise ProviderError(f"local node sandbox: cannot make the {what} {real}: {e.strerror or e}") from None
        if real in self.fds:
            return real
        fd = pin(real, what)
        if fd is not None:
            self.fds[real] = fd
            (self.rw if writable else self.ro).append(real)
        return real

    def release(self) -> tuple[int, ...]:
        """The descriptors, now the caller's to close (:func:`wrap`: its :class:`Command`'s);
        these binds cannot be given to another sandbox after."""
        fds = tuple(self.fds.values())
        self.fds = {}
        self.released = True
        return fds

    def close(self) -> None:
        """Close the descriptors not released (idempotent)."""
        fds, self.fds = self.fds, {}
        for fd in fds.values():
            os.close(fd)

    def __del__(self) -> None:
        self.close()


def pin(real: Path, what: str) -> int | None:
    """An ``O_PATH`` descriptor (close-on-exec) of ``real``, a path :func:`check_bind` resolved
    and checked, that is the object at that very path now: the descriptor's
    ``/proc/self/fd/N`` names ``real`` and it is not a symlink. A link put in place of one of
    ``real``'s directories after the check (``realpath``) would lead the open elsewhere: that
    is refused, and bwrap gets the descriptor, not the path. None when ``real`` does not exist.

    Raises:
        ProviderError: ``real`` cannot be opened, or is not the object checked (exit 4).
    """
    try:
        fd = os.open(real, os.O_PATH | os.O_NOFOLLOW | os.O_CLOEXEC)
    except FileNotFoundError:
        return None
    except OSError as e:
        raise ProviderError(f"local node sandbox: cannot open the {what} {real}: {e.strerror or e}") from None
    try:
        link = stat.S_ISLNK(os.fstat(fd).st_mode)
        where = os.readlink(f"/proc/self/fd/{fd}")
    except OSError as e:
        os.close(fd)
        raise ProviderError(f"local node sandbox: cannot open the {what} {real}: {e.strerror or e}") from None
    if link or where != str(real):
        os.close(fd)
        if link:
            try:
                where = f"is a link now, to {os.readlink(real)}"
            except OSError:
                where = "is a link now"
        else:
            where = f"now leads to {where}"
        raise ProviderError(f"local node sandbox: the {what} {real} changed while it was checked (it {where}); "
                            f"a job cannot be given it",
                            hint=f"leave the {what}'s path as it is while the job starts, then launch it again")
    return fd


def _runtime_dirs(covered: list[Path]) -> list[Path]:
    """The Python prefixes and sftctl's package (resolved) that lie under a ``covered``
    directory (a hidden one: the node's python, torch and sftctl must stay readable; a
    read-write bind, such as a workdir that is sftctl's checkout: they must stay read-only)."""
    import sftctl

    out = []
    for p in (sys.prefix, sys.base_prefix, sys.exec_prefix, os.path.dirname(sys.executable),
              os.path.dirname(os.path.realpath(sys.executable)), os.path.dirname(sftctl.__file__)):
        real = _real(p)
        if any(_within(real, c) for c in covered) and not any(_within(s, real) for s in sensitive_paths()):
            out.append(real)
    return [p for p in out if not any(q != p and _within(p, q) for q in out)]  # one inside another: the outer


class Command:
    """A command to start: ``argv`` and ``pass_fds``, the file descriptors it needs (give both to
    :class:`subprocess.Popen`, and through :func:`sftctl.procs.guard` when it starts it), then
    :meth:`close` them once it started (a ``with`` block does). ``Command(argv)``: a plain one,
    no descriptor."""

    def __init__(self, argv: list[str], pass_fds: tuple[int, ...] = ()):
        self.argv = argv
        self.pass_fds = pass_fds

    def close(self) -> None:
        """Close this process's copy of each descriptor (idempotent)."""
        fds, self.pass_fds = self.pass_fds, ()
        for fd in fds:
            os.close(fd)

    def __enter__(self) -> Command:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def wrap(argv: list[str], binds: Binds, *, tags: dict[str, str], chdir: str | os.PathLike) -> Command:
    """``argv`` under bwrap as the module docstring says: ``binds`` given back, ``tags`` set
    inside, started in ``chdir``. The command line is ``bwrap --args FD -- ARGV...``: bwrap reads
    its options (:func:`options`), NUL-separated, from ``FD``, an anonymous memory file
    (``memfd_create``, close-on-exec but in the process given ``pass_fds``) that only this
    process and the ones it starts hold; bwrap closes it after reading. No value of ``tags``
    (nor a path) is on a command line. The binds' descriptors (:meth:`Binds.release`) follow it
    in ``pass_fds``: bwrap binds each as ``/proc/self/fd/N``, the directory checked.

    Raises:
        ProviderError: bwrap is not installed, a tag holds a NUL byte, or ``binds`` went to a
            sandbox already (exit 4).
    """
    bwrap = bwrap_path()
    if bwrap is None:
        raise ProviderError("local node sandbox: bubblewrap (bwrap) is not installed",
                            hint="apt-get install bubblewrap, or have an admin set SFTCTL_NODE_SANDBOX=off (unsafe)")
    bad = next((k for k, v in tags.items() if "\0" in k or "\0" in v), None)
    if bad is not None:
        raise ProviderError(f"local node sandbox: the variable {bad!r} holds a NUL byte, which no environment "
                            f"can carry", hint=f"remove the NUL byte from {bad!r} in the job's env:")
    data = b"".join(os.fsencode(a) + b"\0" for a in options(binds, tags=tags, chdir=chdir))
    fd = os.memfd_create("sftctl-bwrap-args", os.MFD_CLOEXEC)
    try:
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view):]
        os.lseek(fd, 0, os.SEEK_SET)
    except OSError as e:
        os.close(fd)
        raise ProviderError(f"local node sandbox: cannot write bwrap's options: {e.strerror or e}") from None
    return Command([bwrap, "--args", str(fd), "--", *argv], (fd, *binds.release()))


def options(binds: Binds, *, tags: dict[str, str], chdir: str | os.PathLike) -> list[str]:
    """bwrap's options for :func:`wrap` (not its path, not the command): the mounts and
    namespaces of the module docstring, ``binds`` given back, ``--setenv`` of each of ``tags``,
    ``--chdir`` ``chdir``. They hold values of the node's environment: never on a command line."""
    if binds.released:
        raise ProviderError("local node sandbox: these binds were given to a sandbox already; check them again")
    system = _outermost([_real(p) for p in SYSTEM_HIDDEN if os.path.isdir(p) and not os.path.islink(p)])
    sensitive = sensitive_paths()
    secret_dirs = [p for p in _outermost([p for p in sensitive if p.is_dir()]) if p not in system]
    resolv = _real("/etc/resolv.conf")
    ro = [*_runtime_dirs(system + secret_dirs + binds.rw), *binds.ro]
    if resolv.exists() and any(_within(resolv, h) for h in system):
        ro.append(resolv)
    mounts = sorted({(p, False) for p in ro} | {(p, True) for p in binds.rw if p not in ro},
                    key=lambda m: (len(m[0].parts), m[1]))  # outer first: an inner bind stays visible

    def bind(path: Path, writable: bool) -> list[str]:
        # a bind of the job's: the descriptor pinned when it was checked, never its path again
        source = f"/proc/self/fd/{binds.fds[path]}" if path in binds.fds else str(path)
        return ["--bind" if writable else "--ro-bind", source, str(path)]

    def in_secret(p: Path) -> bool:
        return any(_within(p, s) for s in secret_dirs)

    out = ["--ro-bind", "/", "/", "--dev-bind", "/dev", "/dev", "--tmpfs", "/dev/shm", "--proc", "/proc",
           "--unshare-pid", "--unshare-ipc", "--unshare-uts", "--new-session", "--cap-drop", "ALL"]
    for h in system:
        out += ["--tmpfs", str(h)]
    for path, writable in mounts:  # what lies outside the server's own directories
        if not in_secret(path):
            out += bind(path, writable)
    for h in secret_dirs:  # after those binds: a workdir that holds one has it hidden again
        out += ["--tmpfs", str(h)]
    covers = system + secret_dirs + [m for m, _ in mounts]
    for f in (p for p in sensitive if p.is_file()):  # a file still in sight: an empty one over it
        covering = [c for c in covers if _within(f, c)]
        if not covering or max(covering, key=lambda c: len(c.parts)) in {m for m, _ in mounts}:
            out += ["--ro-bind", "/dev/null", str(f)]
    for path, writable in mounts:  # the node's own directories inside the server's home, runtimes under $HOME
        if in_secret(path):
            out += bind(path, writable)
    scratch = {_real(p) for p in SCRATCH}
    for h in [*reversed(secret_dirs), *reversed(system)]:  # after the binds made their mount points
        if h not in scratch:
            out += ["--remount-ro", str(h)]
    for k, v in tags.items():
        out += ["--setenv", k, v]
    return [*out, "--chdir", str(chdir)]


#: variables that make the dynamic loader (glibc's list of those it ignores in a setuid
#: program, and its tunables) or Python run code of the job's: never in the environment of the
#: guard and bwrap, which run outside the sandbox as the server
LOADER_ENV = ("GCONV_PATH", "GETCONF_DIR", "GLIBC_TUNABLES", "HOSTALIASES", "LOCALDOMAIN", "LOCPATH", "MALLOC_TRACE",
              "NIS_PATH", "NLSPATH", "RESOLV_HOST_CONF", "RES_OPTIONS", "TMPDIR", "TZDIR")


def outside_environ(env: dict[str, str]) -> tuple[dict[str, str], dict[str, str]]:
    """``env`` (a sandboxed node's) split into what the guard and bwrap, outside the sandbox,
    may have and what only the sandbox's processes get (bwrap's ``--setenv``, in the options
    :func:`wrap` passes on a file descriptor): ``LD_*``, ``PYTHON*`` and :data:`LOADER_ENV`. Outside, such a
    variable keeps the server's own value, if it has one."""
    moved = {k: v for k, v in env.items() if k.startswith(("LD_", "PYTHON")) or k in LOADER_ENV}
    outside = {k: v for k, v in env.items() if k not in moved}
    outside.update({k: os.environ[k] for k in moved if k in os.environ})
    return outside, moved


def loopback_identity(rank: int) -> dict[str, str]:
    """``PET_LOCAL_ADDR``, a loopback address of node ``rank``'s own (``127.1.x.y``): torchrun's
    c10d rendezvous tells nodes apart by (address, pid), and sandboxed nodes on one machine share
    its host name and, each in its own pid namespace, their pids (torchrun is pid 8 in each):
    two nodes would count as one and the rendezvous wait forever. All of 127.0.0.0/8 is this
    machine, so rank 0's address (the workers' master address) is reachable from every node."""
    return {"PET_LOCAL_ADDR": f"127.1.{rank // 254 % 256}.{rank % 254 + 1}"}


def node_environ(node: dict[str, str], home: str | os.PathLike) -> dict[str, str]:
    """The environment of a sandboxed node: of this process's environment only :data:`KEPT_ENV`,
    ``LC_*`` and the declared node settings (:mod:`sftctl.settings`, scope node); then ``node``
    (what the controller and provider built: the job's env and secrets, the node settings);
    ``HOME`` = ``home``. Nothing else of the server's (its state URL, home, config, server
    tokens, cloud credentials)."""
    node_settings = {s.name for s in settings.DECLARED if s.scope == settings.NODE}
    env = {k: v for k, v in os.environ.items() if k in KEPT_ENV or k.startswith("LC_") or k in node_settings}
    env.update(node)
    env["HOME"] = str(home)
    return env
