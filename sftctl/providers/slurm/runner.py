"""Where Slurm commands run: on this login node (:class:`LocalRunner`) or over SSH
(:class:`SSHRunner`, one multiplexed connection), and how files are read back in one round trip."""

from __future__ import annotations

import base64
import hashlib
import json
import os
import shlex
import subprocess
import tempfile
import time
from pathlib import Path

from sftctl.errors import ProviderError
from sftctl.slurm_config import SlurmConfig

_READ_FILES = r"""
def read_files(req):
    import glob
    files = dict(req.get("files", {}))
    for pattern in req.get("globs", []):
        for p in glob.glob(pattern):
            files.setdefault(p, 0)
    out = {}
    for p, off in files.items():
        try:
            with open(p, "rb") as f:
                f.seek(off)
                out[p] = f.read(16 << 20)
        except OSError:
            pass
    return out
"""

#: What a remote read does: given {"files": {path: offset}, "globs": [pattern]}, print JSON
#: {path: base64 bytes from its offset (16 MiB at most)} for each file that exists. Runs with
#: the remote python3 (SSH mode); login-node mode runs the same ``read_files`` in this process
#: (:func:`_read_local`): one round trip per node per poll.
_READ_SCRIPT = _READ_FILES + r"""
import base64, json, sys
print(json.dumps({p: base64.b64encode(d).decode() for p, d in read_files(json.loads(sys.argv[1])).items()}))
"""


def _read_local(req: dict) -> dict[str, bytes]:
    """:data:`_READ_SCRIPT`'s read, in this process: ``{path: bytes from its offset}``."""
    namespace: dict = {}
    exec(_READ_FILES, namespace)  # the very code the remote read runs
    return namespace["read_files"](req)


class Runner:
    """Runs commands and moves files where Slurm is: here (login node) or over SSH."""

    remote = False

    def run(self, argv: list[str], *, input: bytes | None = None, timeout: float = 60,
            check: bool = True) -> subprocess.CompletedProcess:
        raise NotImplementedError

    def write_files(self, files: dict[str, tuple[str, int]]) -> None:
        """Write ``{path: (text, mode)}``, creating directories (0700)."""
        raise NotImplementedError

    def read(self, req: dict) -> dict[str, bytes]:
        raise NotImplementedError

    def home(self) -> str:
        raise NotImplementedError

    def upload_dir(self, local: str, remote: str) -> None:
        """Copy the directory ``local`` of this machine to ``remote`` on the cluster (a remote runner's)."""
        raise NotImplementedError


class LocalRunner(Runner):
    """Slurm commands in this shell (a login node); files on this (shared) filesystem."""

    def run(self, argv, *, input=None, timeout=60, check=True):
        try:
            proc = subprocess.run(argv, input=input, capture_output=True, timeout=timeout)
        except FileNotFoundError:
            raise ProviderError(f"slurm: {argv[0]} not found", hint="run sftctl on a login node, or set slurm.host") from None
        except subprocess.TimeoutExpired:
            raise ProviderError(f"slurm: {' '.join(argv[:2])} did not answer within {timeout:.0f} s",
                                hint="is slurmctld up? scontrol ping") from None
        if check and proc.returncode != 0:
            raise _command_error(argv, proc)
        return proc

    def write_files(self, files):
        for path, (text, mode) in files.items():
            p = Path(path)
            p.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
            tmp = p.with_name(p.name + ".tmp")
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, mode)
            with os.fdopen(fd, "w") as f:
                f.write(text)
            os.chmod(tmp, mode)
            tmp.replace(p)

    def read(self, req):
        return _read_local(req)

    def home(self):
        return str(Path.home())


#: a unix socket's path holds at most 108 bytes (Linux; 104 on macOS), and ssh first binds the
#: control socket at the path plus a 17-character random suffix
_SOCKET_PATH_MAX = 104 - 17


def _control_dir(home: Path) -> Path:
    """The directory of this home's ssh ControlMaster sockets: ``<home>/ssh``, or, when a path in
    it would be too long for a unix socket (a deep ``SFTCTL_HOME``), ``sftctl-ssh-<uid>`` in the
    temporary directory. Created 0700; raises ProviderError when that directory belongs to another
    user or others can enter it (someone else could put a socket there)."""
    d = home / "ssh"
    if len(str(d / "cm-000000000000")) > _SOCKET_PATH_MAX:
        d = Path(tempfile.gettempdir()) / f"sftctl-ssh-{os.getuid()}"
    d.mkdir(parents=True, exist_ok=True, mode=0o700)
    st = d.stat()
    if st.st_uid != os.getuid() or st.st_mode & 0o077:
        raise ProviderError(f"slurm: {d} (ssh control sockets) belongs to uid {st.st_uid} or is open to "
                            f"others (mode {st.st_mode & 0o777:o})", hint="remove it, or set a shorter SFTCTL_HOME")
    return d


class SSHRunner(Runner):
    """Every command through the system ``ssh`` to the login node, over one reused connection.

    ``ControlMaster=auto`` with a control socket per (user, host, port) under ``$SFTCTL_HOME``
    and ``ControlPersist=300``: the first command pays the handshake, later ones reuse it.
    ``BatchMode=yes``: a missing key is an error, never a password prompt.
    """

    remote = True

    def __init__(self, cfg: SlurmConfig):
        from sftctl.paths import sftctl_home

        self.cfg = cfg
        self.target = f"{cfg.user}@{cfg.host}" if cfg.user else cfg.host
        home = sftctl_home()
        digest = hashlib.sha256(f"{home}:{self.target}:{cfg.port}".encode()).hexdigest()[:12]
        self.control_path = str(_control_dir(home) / f"cm-{digest}")
        self._home: str | None = None

    def ssh_argv(self) -> list[str]:
        argv = ["ssh", "-p", str(self.cfg.port), "-o", "BatchMode=yes", "-o", "ControlMaster=auto",
                "-o", f"ControlPath={self.control_path}", "-o", "ControlPersist=300",
                "-o", "ConnectTimeout=15", "-o", "ServerAliveInterval=15"]
        if self.cfg.key:
            argv += ["-i", str(Path(self.cfg.key).expanduser()), "-o", "IdentitiesOnly=yes"]
        for opt in self.cfg.ssh_options:
            argv += ["-o", str(opt)]
        return argv + [self.target]

    def run(self, argv, *, input=None, timeout=60, check=True):
        cmd = self.ssh_argv() + ["--", " ".join(shlex.quote(a) for a in argv)]
        try:
            proc = subprocess.run(cmd, input=input, capture_output=True, timeout=timeout,
                                  stdin=None if input is not None else subprocess.DEVNULL)
        except FileNotFoundError:
            raise ProviderError("slurm: the ssh client is not installed", hint="apt-get install openssh-client") from None
        except subprocess.TimeoutExpired:
            raise ProviderError(f"slurm: ssh {self.target} did not answer within {timeout:.0f} s",
                                hint=f"check ssh -p {self.cfg.port} {self.target} works") from None
        if proc.returncode == 255:
            err = proc.stderr.decode(errors="replace").strip().splitlines()
            raise ProviderError(f"slurm: ssh {self.target}: {err[-1] if err else 'connection failed'}",
                                hint="check slurm.host, slurm.user, slurm.key (ssh -i KEY USER@HOST works?)")
        if check and proc.returncode != 0:
            raise _command_error(argv, proc)
        return proc

    def write_files(self, files):
        # one round trip: a tar stream unpacked under / (paths are absolute)
        import io
        import tarfile

        buf = io.BytesIO()
        with tarfile.open(fileobj=buf, mode="w") as tar:
            dirs = sorted({str(Path(p).parent) for p in files})
            for path, (text, mode) in files.items():
                data = text.encode()
                info = tarfile.TarInfo(path.lstrip("/"))
                info.size, info.mode, info.mtime = len(data), mode, int(time.time())
                tar.addfile(info, io.BytesIO(data))
        script = f"mkdir -p -m 700 {' '.join(shlex.quote(d) for d in dirs)} && tar -x -C / -f -"
        self.run(["bash", "-c", script], input=buf.getvalue())

    def read(self, req):
        proc = self.run(["python3", "-c", _READ_SCRIPT, json.dumps(req)], check=False)
        if proc.returncode != 0:
            raise ProviderError(f"slurm: reading job files on {self.target} failed: "
                                f"{proc.stderr.decode(errors='replace').strip()[-300:]}",
                                hint="the login node needs python3")
        return {p: base64.b64decode(d) for p, d in json.loads(proc.stdout or b"{}").items()}

    def home(self):
        if self._home is None:
            self._home = self.run(["bash", "-c", "echo $HOME"]).stdout.decode().strip()
        return self._home

    def upload_dir(self, local: str, remote: str) -> None:
        """Copy directory ``local`` to ``remote`` (a tar stream; ``.git``, venvs, caches left out)."""
        tar = subprocess.Popen(["tar", "-C", local, "--exclude=.git", "--exclude=.venv", "--exclude=.ci-venv",
                                "--exclude=__pycache__", "--exclude=*.pyc", "-cf", "-", "."],
                               stdout=subprocess.PIPE)
        data = tar.stdout.read()
        tar.wait()
        self.run(["bash", "-c", f"mkdir -p {shlex.quote(remote)} && tar -x -C {shlex.quote(remote)} -f -"],
                 input=data, timeout=600)


def _command_error(argv: list[str], proc: subprocess.CompletedProcess) -> ProviderError:
    err = (proc.stderr or b"").decode(errors="replace").strip()
    line = err.splitlines()[-1] if err else f"exit code {proc.returncode}"
    return ProviderError(f"slurm: {argv[0]} failed: {line}", hint="sftctl check slurm; sinfo shows the cluster")
