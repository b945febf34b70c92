"""Frontends trace a whole training step (forward, loss, backward, optimizer) into the IR.

``torch/`` (make_fx) and ``jax/`` (make_jaxpr) each offer ``trace_step`` and
``trace_entrypoint``; the job spec's ``model.entrypoint`` (``file.py:function``) is loaded with
:func:`load_entrypoint`.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from typing import Callable


def user_prints_to_stderr(fn: Callable) -> Callable:
    """Run ``fn`` with ``sys.stdout`` sent to ``sys.stderr``: what the user's code prints while it is
    imported, built and traced (a model's ``print`` in its forward, a banner at import) never lands
    on the stdout of a ``--json`` command, whose document must parse; it stays visible on stderr."""
    import contextlib
    import functools

    @functools.wraps(fn)
    def wrapped(*args, **kwargs):
        with contextlib.redirect_stdout(sys.stderr):
            return fn(*args, **kwargs)
    return wrapped


class EntrypointFileNotFound(FileNotFoundError):
    """``model.entrypoint``'s file does not exist: the spec's mistake, not the model's."""


class EntrypointFunctionNotFound(AttributeError):
    """``model.entrypoint``'s file has no such function: the spec's mistake (a typo)."""


def load_entrypoint(entrypoint: str, workdir: str) -> Callable:
    """Import ``file.py:function`` (``file.py`` relative to ``workdir``) and return the function.

    The file's directory is on ``sys.path`` while it is imported, so it may import its siblings.

    Raises:
        EntrypointFileNotFound: (a FileNotFoundError) the file does not exist.
        EntrypointFunctionNotFound: (an AttributeError) the file has no such function.
        Exception: whatever the module raises while it is imported.
    """
    file, _, func = entrypoint.rpartition(":")
    path = (Path(workdir) / file).resolve()
    if not path.is_file():
        raise EntrypointFileNotFound(f"entrypoint file {path} not found")
    mod_name = f"_sftctl_entry_{abs(hash(str(path)))}"
    mod_spec = importlib.util.spec_from_file_location(mod_name, path)
    module = importlib.util.module_from_spec(mod_spec)
    sys.modules[mod_name] = module  # dataclasses and pickling look the module up
    sys.path.insert(0, str(path.parent))
    try:
        mod_spec.loader.exec_module(module)
    except BaseException:
        sys.modules.pop(mod_name, None)
        raise
    finally:
        sys.path.remove(str(path.parent))
    fn = getattr(module, func, None)
    if not callable(fn):
        raise EntrypointFunctionNotFound(f"{file} has no function {func!r}")
    return fn
