"""What runs the server elsewhere (``sftctl server manifest``): Kubernetes objects or a systemd
unit, rendered from ``templates/server/`` (Jinja2, the templates' one environment)."""

from __future__ import annotations

import shlex
import sys
from pathlib import Path
from typing import Mapping

from sftctl import __version__


def kubernetes(*, port: int = 8470, image: str = "sftctl:latest", namespace: str | None = None,
               claim: str = "sftctl-state", secrets: Mapping[str, str] | None = None) -> str:
    """A Secret (``secrets``: the environment the jobs' ``secrets:`` name, NAME -> value; the pod
    gets them through ``envFrom``), a Deployment of one replica (``Recreate``: one server per
    state; ``$SFTCTL_HOME`` on the PersistentVolumeClaim ``claim``, which must exist; probes on
    ``/v1/health``) and a ClusterIP Service on ``port``: three YAML documents."""
    from sftctl.templates import render

    return render("server/k8s.yaml.j2", version=__version__, port=int(port), image=image, namespace=namespace,
                  claim=claim, secrets=dict(secrets or {}))


def systemd(*, port: int = 8470, host: str = "0.0.0.0", home: str | None = None) -> str:
    """A systemd user unit that runs ``sftctl server start`` with this Python's sftctl; its
    ``$SFTCTL_HOME`` is ``home`` (default: this shell's, when set)."""
    from sftctl.procs import module_argv
    from sftctl.templates import render

    argv = module_argv("sftctl.cli", "server", "start", "--host", host, "--port", str(int(port)),
                       python=str(Path(sys.executable)))
    from sftctl import settings

    home = home if home is not None else settings.raw("SFTCTL_HOME")
    return render("server/sftctl-server.service.j2", version=__version__, argv=shlex.join(argv), home=home)
