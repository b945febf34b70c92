"""Jinja2 templates: node scripts (``node.sh.j2``), the cloud bootstrap (``bootstrap.sh.j2``) and
Kubernetes manifests (``k8s/*.yaml.j2``).

Every template sees the global ``protocol``, the module :mod:`sftctl.protocol`: node scripts
take the node directory's file names from it (``{{ protocol.exit_name(attempt) }}``, or
``{{ protocol.exit_name("$attempt") }}`` for an attempt the script knows only at run time)
rather than spelling them.

``py_module("sftctl.agent")`` gives the words after a Python that run one of sftctl's modules
as ``-m`` would but never from the working directory (:func:`sftctl.procs.module_argv`).

Filters: ``q`` shell-quotes a value; ``yq`` makes it a one-line YAML double-quoted scalar
(every character escaped as YAML needs); ``b64`` base64-encodes its UTF-8 text (Secret data); ``sbatch`` passes one word of an ``#SBATCH``
line, refusing control characters.
"""

from __future__ import annotations

import base64
import shlex
from functools import lru_cache

from sftctl import protocol
from sftctl.procs import module_argv
from sftctl.slurm_config import control_problem


def _yaml_scalar(value) -> str:
    import yaml

    return yaml.safe_dump(str(value), default_style='"', width=float("inf"), allow_unicode=False).rstrip("\n")


def _py_module(module: str) -> str:
    """``-c '...'``: the shell words after a Python that run sftctl's ``module`` without the
    working directory on ``sys.path`` (:func:`sftctl.procs.module_argv`)."""
    return " ".join(shlex.quote(a) for a in module_argv(module)[1:])


def _sbatch_word(value) -> str:
    """One word of an ``#SBATCH`` line: refused (ValueError) if it holds a control character
    (a newline would end the comment and run the rest as shell on the compute node);
    the ``slurm:`` settings are checked for this long before (:func:`sftctl.slurm_config.control_problem`)."""
    text = str(value)
    problem = control_problem(text)
    if problem:
        raise ValueError(f"#SBATCH {text!r}: {problem}")
    return text


@lru_cache(maxsize=1)
def _env():
    import jinja2

    env = jinja2.Environment(
        loader=jinja2.PackageLoader("sftctl", "templates"),
        undefined=jinja2.StrictUndefined,
        keep_trailing_newline=True,
        autoescape=False,
    )
    env.filters["q"] = lambda v: shlex.quote(str(v))
    env.filters["yq"] = _yaml_scalar
    env.filters["sbatch"] = _sbatch_word
    env.filters["b64"] = lambda v: base64.b64encode(str(v).encode()).decode()

    env.globals["protocol"] = protocol
    env.globals["py_module"] = _py_module
    return env


def render(name: str, **context) -> str:
    """Render template ``name`` (e.g. ``node.sh.j2``); a missing variable raises an error."""
    return _env().get_template(name).render(**context)
