"""A user's model traced where it cannot act as the server: in a child process, under the local
nodes' bubblewrap sandbox (:mod:`sftctl.providers.sandbox`) when the server runs them so.

Tracing runs the model's own Python (``model.entrypoint``: its module, its build function, its
forward and backward on meta tensors). In ``sftctl server``'s process that code would run with
the server's state (every user's token hash, the secrets key), config and credentials. So a
server traces in a child (:func:`trace`): started from nothing but the nodes' environment
(:func:`sftctl.providers.sandbox.node_environ`), ``HOME`` an empty scratch directory, and with
``SFTCTL_NODE_SANDBOX=bwrap`` inside bwrap as a node is (the server's home, ``$HOME``, config and
state hidden; the workdir given back read-only). The child writes the traced step as JSON
(:func:`sftctl.compiler.ir.to_json`) on a copy of its stdout (the model's own prints go to
stderr); the server reads it with :func:`sftctl.compiler.ir.from_json`, which runs no code (a
pickle would), and compiles and prices it itself. A forged graph misleads only its own job's
plan. An error in the child comes back as its kind and first line, and is raised as the same
exception the in-process trace raises (:class:`sftctl.planner.Predictor` words it).

``python -m sftctl.sandboxed_trace ARGS_JSON`` is the child.
"""

from __future__ import annotations

import json
import os
import sys
from typing import Any

#: how long a trace may take (seconds) before the child is killed: a 70B model traces in about
#: a minute on a 2-core machine (meta tensors)
TRACE_TIMEOUT_S = 600.0
#: the largest traced step read back (bytes of JSON): a 70B Llama's is ~10 MB; a file past it is
#: cut by the child's RLIMIT_FSIZE (:func:`child`) and refused
MAX_GRAPH_BYTES = 512 * 2**20
#: the child's stderr kept for an error message (its last bytes)
STDERR_TAIL = 4000


class TraceFailed(Exception):
    """An exception the child's trace raised that has no class of its own here: ``remote_type``
    is its class name, ``str()`` its first line."""

    def __init__(self, remote_type: str, message: str):
        super().__init__(message)
        self.remote_type = remote_type


# ------------------------------------------------------------------------------ the child


def _kind(e: BaseException) -> dict[str, Any]:
    """What the parent needs to raise ``e`` again (see :func:`_raise`)."""
    from sftctl.compiler.frontends import EntrypointFileNotFound, EntrypointFunctionNotFound
    from sftctl.errors import SftctlError

    first = (str(e).splitlines() or [""])[0][:2000]
    if isinstance(e, EntrypointFileNotFound):
        return {"kind": "file", "message": first}
    if isinstance(e, EntrypointFunctionNotFound):
        return {"kind": "function", "message": first}
    if isinstance(e, SyntaxError):
        return {"kind": "syntax", "message": first}
    if isinstance(e, ModuleNotFoundError):
        return {"kind": "module", "message": first, "name": e.name}
    if isinstance(e, SftctlError):
        return {"kind": "spec", "message": e.message, "hint": e.hint}
    if isinstance(e, ImportError):
        return {"kind": "import", "message": first}
    return {"kind": "other", "type": type(e).__name__, "message": first}


def child(args: dict) -> int:
    """Trace ``args`` (:func:`sftctl.compiler.api.trace`'s arguments, no cache) and write
    ``{"graph": ...}`` or ``{"error": ...}`` on the stdout this process started with; everything
    else the process prints goes to stderr. Its files (the result, the log) are held to
    MAX_GRAPH_BYTES first, soft and hard limit: the model's code cannot raise them again."""
    import resource

    resource.setrlimit(resource.RLIMIT_FSIZE, (MAX_GRAPH_BYTES + 1, MAX_GRAPH_BYTES + 1))
    result = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)  # the model's prints (and a library's) never mix into the result
    sys.stdout = sys.stderr
    try:
        from sftctl.compiler.api import trace
        from sftctl.compiler.ir import to_json

        graph = trace(args["framework"], args["entrypoint"], args["workdir"], int(args["batch_size"]), args["dtype"],
                      use_cache=False, mask_fraction=float(args["mask_fraction"]),
                      expert_capacity=float(args["expert_capacity"]), attention=str(args["attention"]))
        doc = '{"graph":' + to_json(graph) + "}"
    except BaseException as e:  # noqa: BLE001 - the parent words every failure of the model's code
        doc = json.dumps({"error": _kind(e)})
    result.write(doc)
    result.flush()
    return 0


# ------------------------------------------------------------------------------ the parent


def _raise(err: Any) -> None:
    """Raise the exception the child's ``error`` document describes."""
    from sftctl.compiler.frontends import EntrypointFileNotFound, EntrypointFunctionNotFound
    from sftctl.errors import SpecError

    if not isinstance(err, dict):
        raise TraceFailed("TraceError", "the tracing process answered with something that is not an error")
    message = str(err.get("message") or "")[:2000]
    kind = err.get("kind")
    if kind == "file":
        raise EntrypointFileNotFound(message)
    if kind == "function":
        raise EntrypointFunctionNotFound(message)
    if kind == "syntax":
        raise SyntaxError(message)
    if kind == "module":
        raise ModuleNotFoundError(message, name=str(err.get("name") or "") or None)
    if kind == "spec":
        hint = err.get("hint")
        raise SpecError(message, hint=str(hint)[:2000] if hint else None)
    if kind == "import":
        raise ImportError(message)
    raise TraceFailed(str(err.get("type") or "Exception")[:80], message)


def trace(framework: str, entrypoint: str, workdir: str, batch_size: int, dtype: str, *,
          mask_fraction: float = 1.0, expert_capacity: float = 1.0, attention: str = "auto",
          timeout_s: float = TRACE_TIMEOUT_S):
    """:func:`sftctl.compiler.api.trace`, run in a child process as the module docstring says;
    the same arguments, the same :class:`~sftctl.compiler.ir.Graph`.

    Raises:
        SandboxUnavailable: ``SFTCTL_NODE_SANDBOX=bwrap`` and bubblewrap cannot start (exit 2).
        ProviderError: the workdir is the server's or inside its home, config or state (exit 4).
        SpecError, EntrypointFileNotFound, EntrypointFunctionNotFound, SyntaxError,
            ModuleNotFoundError, ImportError, TraceFailed: the child's trace raised that.
        TraceFailed: the child died, timed out or answered with a bad document.
    """
    import signal
    import subprocess
    import tempfile
    from pathlib import Path

    from sftctl.compiler.ir import from_json
    from sftctl.procs import module_argv
    from sftctl.providers import sandbox

    args = {"framework": framework, "entrypoint": entrypoint, "workdir": str(workdir), "batch_size": int(batch_size),
            "dtype": dtype, "mask_fraction": float(mask_fraction), "expert_capacity": float(expert_capacity),
            "attention": attention}
    argv = module_argv("sftctl.sandboxed_trace", json.dumps(args))
    with tempfile.TemporaryDirectory(prefix="sftctl-trace-") as tmp:
        out_path, err_path = Path(tmp) / "graph.json", Path(tmp) / "stderr"
        if sandbox.requested():
            sandbox.check()
            binds = sandbox.Binds()
            binds.add(workdir, "-", "workdir", writable=False)  # pinned: bwrap binds the directory checked
            command = sandbox.wrap(argv, binds, tags={}, chdir=workdir)  # its options on a descriptor
            home = "/tmp"  # the sandbox's own empty /tmp
        else:
            command = sandbox.Command(argv)
            home = tmp
        env = sandbox.node_environ({}, home)
        with command, open(out_path, "wb") as out, open(err_path, "wb") as err:
            proc = subprocess.Popen(command.argv, stdin=subprocess.DEVNULL, stdout=out, stderr=err, env=env,
                                    cwd=workdir, start_new_session=True, pass_fds=command.pass_fds)
            try:
                code = proc.wait(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
                raise TraceFailed("TimeoutError", f"tracing took longer than {timeout_s:g} s") from None
            finally:
                if proc.poll() is None:
                    os.killpg(proc.pid, signal.SIGKILL)
                    proc.wait()
        text = out_path.read_bytes()
        if code != 0 or not text:
            tail = err_path.read_bytes()[-STDERR_TAIL:].decode("utf-8", "replace").strip().splitlines()
            raise TraceFailed("TraceError", f"the tracing process ended with code {code}"
                              + (f": {tail[-1]}" if tail else ""))
    if len(text) > MAX_GRAPH_BYTES:
        raise TraceFailed("TraceError", f"the traced step is larger than {MAX_GRAPH_BYTES} bytes")
    try:
        if text.startswith(b'{"error"'):
            _raise(json.loads(text).get("error"))
        if not text.startswith(b'{"graph":') or not text.endswith(b"}"):
            raise ValueError("not a graph document")
        graph = from_json(text[len(b'{"graph":'):-1])
    except (ValueError, RecursionError) as e:
        raise TraceFailed("TraceError", f"the tracing process answered with a bad graph: {e}") from None
    return graph


def main(argv: list[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if len(args) != 1:
        sys.stderr.write("usage: python -m sftctl.sandboxed_trace ARGS_JSON\n")
        return 2
    return child(json.loads(args[0]))


if __name__ == "__main__":
    raise SystemExit(main())
