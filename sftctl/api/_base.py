"""The api's boundary (see :mod:`sftctl.api`): argument types checked by name (:func:`_typed`),
whether this process is the server (:func:`_serving`), the configured server's client
(:func:`_remote`), this machine's store and a job id's record (:func:`_store`, :func:`_resolve`),
owner-only files (:func:`_owner_only`) and the config file's check (:func:`validate_config`)."""

from __future__ import annotations

import contextlib
import os
import sys
from typing import TYPE_CHECKING, Any, Callable, Iterator, Mapping, Sequence, TypeAlias

from sftctl.errors import NotFoundError
from sftctl.types import JobRecord

if TYPE_CHECKING:
    from sftctl.spec import JobSpec
    from sftctl.state import Store


SpecLike: TypeAlias = "str | os.PathLike | JobSpec"
Overrides: TypeAlias = "Sequence[str] | Mapping[str, Any]"
Progress: TypeAlias = Callable[[str], None]


# ------------------------------------------------------------------------------ argument types


def _type_name(value: Any) -> str:
    if isinstance(value, (list, tuple)) and value:
        return f"{type(value).__name__}[{' | '.join(sorted({type(v).__name__ for v in value}))}]"
    return "None" if value is None else type(value).__name__


#: what a ``job`` argument may be besides a job id: record type -> its attribute holding the id
#: (:class:`~sftctl.api.JobView` and :class:`~sftctl.api.Submitted` add themselves where defined)
JOB_ARGS: dict[type, str] = {JobRecord: "id"}


def _arg_job(value: Any, optional: bool) -> Any:
    if isinstance(value, str):
        return value
    for kind, attr in JOB_ARGS.items():
        if isinstance(value, kind):
            return getattr(value, attr)
    if value is None and optional:
        return None
    return TypeError


def _arg_spec(value: Any, optional: bool) -> Any:
    spec_module = sys.modules.get("sftctl.spec")  # a JobSpec exists only once sftctl.spec is imported
    ok = isinstance(value, (str, os.PathLike)) or (spec_module is not None and isinstance(value, spec_module.JobSpec))
    return value if ok else TypeError


def _arg_overrides(value: Any, optional: bool) -> Any:
    if isinstance(value, str) or value is None:
        return () if value is None else value
    if isinstance(value, Mapping):
        return value if all(isinstance(k, str) for k in value) else TypeError
    if isinstance(value, (list, tuple)) and all(isinstance(v, str) for v in value):
        return value
    return TypeError


def _arg_names(value: Any, optional: bool) -> Any:
    if value is None or isinstance(value, str):
        return value if value is None else [value]
    if isinstance(value, (list, tuple)) and all(isinstance(v, str) for v in value):
        return list(value)
    return TypeError


def _arg_labels(value: Any, optional: bool) -> Any:
    if value is None:
        return value
    ok = isinstance(value, Mapping) and all(isinstance(k, str) and isinstance(v, str) for k, v in value.items())
    return dict(value) if ok else TypeError


def _arg_text(value: Any, optional: bool) -> Any:
    return value if isinstance(value, str) or (value is None and optional) else TypeError


def _arg_rank(value: Any, optional: bool) -> Any:
    ok = isinstance(value, int) and not isinstance(value, bool) or (value is None and optional)
    return value if ok else TypeError


def _arg_path(value: Any, optional: bool) -> Any:
    return value if isinstance(value, (str, os.PathLike)) or (value is None and optional) else TypeError


#: argument name -> (its converter, what it accepts): the same name means the same thing in
#: every function of this module
_ARGS: dict[str, tuple[Callable[[Any, bool], Any], str]] = {
    "job": (_arg_job, "a job id (str) or a JobView/JobRecord"),
    "spec": (_arg_spec, "a path (str or os.PathLike), YAML text or a JobSpec"),
    "overrides": (_arg_overrides, "a list of 'key.path=value' strings or a mapping {'key.path': value}"),
    "clouds": (_arg_names, "a cloud name (str) or a list of them"),
    "regions": (_arg_names, "a region name (str) or a list of them"),
    "accelerator": (_arg_text, "an accelerator name (str)"),
    "target": (_arg_text, "an accelerator name (str)"),
    "node": (_arg_rank, "a node rank (int)"),
    "rank": (_arg_rank, "a training rank (int)"),
    "out": (_arg_path, "a directory path (str or os.PathLike)"),
    "file": (_arg_path, "a file path (str or os.PathLike)"),
    "source": (_arg_text, "a source label (str)"),
    "labels": (_arg_labels, "a mapping of label keys to values {str: str}"),
}


def _typed(fn: Callable) -> Callable:
    """Check (and normalize) the arguments of a public function at the boundary, by name (see
    :data:`_ARGS`): a wrong type is a :class:`TypeError` naming the function, the argument and
    what it accepts (``api.status: job must be a job id (str) or a JobView/JobRecord, got int``),
    never an internal error further in. An argument whose default is None may be None."""
    import functools
    import inspect

    sig = inspect.signature(fn)
    checked = {n: p.default is None for n, p in sig.parameters.items() if n in _ARGS}

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        bound = sig.bind(*args, **kwargs)
        for name, optional in checked.items():
            if name in bound.arguments:
                convert, accepts = _ARGS[name]
                value = convert(bound.arguments[name], optional)
                if value is TypeError:
                    raise TypeError(f"api.{fn.__name__}: {name} must be {accepts}"
                                    f"{', or None' if optional else ''}, got {_type_name(bound.arguments[name])}")
                bound.arguments[name] = value
        return fn(*bound.args, **bound.kwargs)

    return wrapper


def _serving() -> bool:
    """True in the ``sftctl server`` process (it sets :data:`sftctl.api.SERVING`): its calls
    are this machine's, whatever the config names, and its reads leave a job whose controller
    died to its Supervisor (:func:`_reap`)."""
    return bool(getattr(sys.modules.get("sftctl.api"), "SERVING", False))


def _reap(store: Store) -> None:
    """Mark live jobs whose controller process is gone FAILED_CONTROLLER (every read does,
    :func:`_resolve`), except in the server: its :class:`sftctl.server.Supervisor` gives such a
    job a new controller, which adopts it where it stands."""
    if not _serving():
        store.reap_dead_controllers()


def _remote():
    """The configured server's :class:`sftctl.remote.Client`, or None (no server configured, or
    this process is the server). Job commands go there instead of this machine's state.

    Raises:
        SettingError: a malformed setting or config file (exit 2).
    """
    if _serving():
        return None
    from sftctl import remote

    return remote.configured()


# ------------------------------------------------------------------------------ settings


def validate_config() -> str | None:
    """Check the config file as a whole (every ``sftctl`` command does this first: its keys,
    value types and ``slurm:`` section; :func:`sftctl.settings.config_document`); return its
    path, or None when there is none.

    Raises:
        SettingError: ``$SFTCTL_CONFIG`` names no file, or the file has a mistake (the message
            names the file, line and key; exit 2).
    """
    from sftctl import settings

    return settings.config_document()[0]


@contextlib.contextmanager
def _owner_only() -> Iterator[None]:
    """Everything a job writes (state, logs, node scripts, checkpoints, local storage) is
    owner-only, whatever the mode of an existing ``$SFTCTL_HOME`` or storage directory."""
    old = os.umask(0o077)
    try:
        yield
    finally:
        os.umask(old)


def _store() -> Store:
    from sftctl.state import Store

    return Store()


def _resolve(store: Store, job: str) -> JobRecord:
    """A job by id or unique id prefix. Every read goes through here, so every one sees a dead
    controller: live jobs whose controller process is gone are marked FAILED_CONTROLLER first.

    Raises:
        NotFoundError: empty, unknown or ambiguous id (exit 2).
    """
    if not job.strip():
        raise NotFoundError("the job id is empty", hint="sftctl status lists the jobs")
    _reap(store)
    record = store.get_job(job)
    if record is not None:
        return record
    matches = [j.id for j in store.list_jobs() if j.id.startswith(job)]
    if len(matches) == 1:
        return store.get_job(matches[0])
    if matches:
        raise NotFoundError(f"{job!r} matches {len(matches)} jobs", hint=f"give more of the id: {', '.join(matches[:5])}")
    raise NotFoundError(f"no job {job!r}", hint="sftctl status lists the jobs")
