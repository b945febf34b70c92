"""Where a server's user may keep a job's workdir (``server.workdir_roots``).

On a server, a job's ``workdir:`` is bound read-write into its local nodes' sandbox
(:mod:`sftctl.providers.sandbox`), so without a rule alice could name bob's project and write to
it. ``SFTCTL_SERVER_WORKDIR_ROOTS`` (config ``server.workdir_roots``: a list of directories;
the environment's is ``os.pathsep``-separated) names where each user's workdirs may lie; ``{user}``
in a root is the job owner's sftctl user name (``/srv/lab/{user}``). Unset: any workdir, as
before (docs/server.md says to set it on a shared machine).

Both the workdir and the roots are compared resolved (:func:`os.path.realpath`: symlinks followed,
``..`` removed), so a link inside alice's root that points into bob's is outside hers. The server
checks at submit (:mod:`sftctl.server.app`: HTTP 403, exit 2) and the local provider again where
it binds the workdir (a path may have become a link since: :class:`~sftctl.errors.ProviderError`),
once more on the directory it opened for the bind (:func:`sftctl.providers.sandbox.pin`): bwrap
binds that descriptor, so a link swapped in after this last check is not followed.
This module lives in ``providers/`` (layer 2) so that the local provider and the server both
import it without pulling in the spec package (pydantic) on the provider's light path.
"""

from __future__ import annotations

import os

from sftctl import settings

#: what a root's ``{user}`` is replaced with
USER_FIELD = "{user}"
#: the fix named when a workdir is refused
HINT = ("the server's admin sets the roots: server.workdir_roots in its config file "
        "(or SFTCTL_SERVER_WORKDIR_ROOTS), {user} standing for each user's name")


def roots(owner: str) -> list[str] | None:
    """The directories ``owner``'s workdirs may lie in, resolved (``{user}`` replaced), in the
    setting's order; None when ``server.workdir_roots`` is unset (every workdir allowed).

    A root naming ``{user}`` gives no directory for an owner named ``.`` or ``..`` or holding a
    path separator (such a name would climb out of the lab's tree), so that owner may use only
    the roots without ``{user}``.

    Raises:
        SettingError: the setting or the config file is malformed (exit 2).
    """
    configured = settings.get("SFTCTL_SERVER_WORKDIR_ROOTS")
    if configured is None:
        return None
    odd = owner in ("", ".", "..") or os.sep in owner or (os.altsep is not None and os.altsep in owner)
    out: list[str] = []
    for root in configured:
        if USER_FIELD in root:
            if odd:
                continue
            root = root.replace(USER_FIELD, owner)
        resolved = os.path.realpath(root)
        if resolved not in out:
            out.append(resolved)
    return out


def refusal(workdir: str, owner: str, resolved: str | None = None) -> str | None:
    """None when ``owner`` may use ``workdir`` (the setting unset, or the workdir, resolved, is
    one of the owner's :func:`roots` or lies inside one); else the one line that says why: it
    names ``workdir``, the resolved path (and the path as given when they differ), the allowed
    roots and the fix (:data:`HINT` says who sets the roots). ``resolved``: the path to judge
    instead of resolving ``workdir`` again (the local provider's: the directory it pinned for
    the bind, :func:`sftctl.providers.sandbox.pin`, whatever the path leads to now).

    Raises:
        SettingError: the setting or the config file is malformed (exit 2).
    """
    allowed = roots(owner)
    if allowed is None:
        return None
    resolved = os.path.realpath(workdir) if resolved is None else resolved
    if any(os.path.commonpath([resolved, root]) == root for root in allowed):
        return None
    given = "" if resolved == os.path.normpath(workdir) else f" ({workdir}, links followed)"
    where = ", ".join(allowed) if allowed else "none"
    return (f"workdir: {resolved}{given} is outside {owner}'s workdir roots on this server ({where}); "
            f"put the job's files in a directory under one of them and name it as workdir")
