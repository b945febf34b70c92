"""Providers turn offerings into nodes. See :mod:`sftctl.providers.base` for the protocol.

Which providers exist is discovered, never listed: every package under ``sftctl/providers/``
declares itself as ``PROVIDER`` (a :class:`~sftctl.providers.base.ProviderEntry`: its class, SDK,
pip extra and how to tell it is configured here), and ``SFTCTL_PROVIDERS`` (``NAME=MODULE``, a
module anywhere on ``sys.path`` declaring ``PROVIDER``) adds more. The names come from
:func:`sftctl.settings.provider_names` (a listing of the directory: nothing imported), so the
spec's ``resources.clouds`` and ``SFTCTL_CLOUDS`` take exactly these.

Cloud SDKs are imported inside their provider module only; importing this package is cheap, and
so is :func:`usable_providers` (it looks for credentials where the SDKs look, without a network
call; ``sftctl check`` makes the real calls).
"""

from __future__ import annotations

import functools
import importlib
import importlib.util
from collections.abc import Mapping
from typing import Any

from sftctl import settings
from sftctl.errors import ProviderError
from sftctl.providers.base import Provider, ProviderEntry
from sftctl.types import capabilities


def names() -> tuple[str, ...]:
    """Every provider's name: the packages of ``sftctl/providers/`` (``local`` first), then
    ``SFTCTL_PROVIDERS``'s (:func:`sftctl.settings.provider_names`)."""
    return settings.provider_names()


@functools.cache
def _entry(name: str, module: str) -> ProviderEntry:
    try:
        mod = importlib.import_module(module)
    except ModuleNotFoundError as e:
        if e.name and module.startswith(e.name):  # the plugin's own module, not a module it imports
            raise ProviderError(f"provider {name!r}: its module {module!r} is not importable",
                                hint="fix SFTCTL_PROVIDERS (NAME=MODULE) or sys.path") from None
        raise
    entry = getattr(mod, "PROVIDER", None)
    if not isinstance(entry, ProviderEntry) or entry.name != name:
        raise ProviderError(f"provider {name!r}: {module} declares no PROVIDER = ProviderEntry({name!r}, ...)",
                            hint="see sftctl/providers/base.py's ProviderEntry")
    return entry


def entry(name: str) -> ProviderEntry:
    """The declaration of provider ``name`` (its module imported: cheap, SDKs are imported
    inside the provider's functions).

    Raises:
        ProviderError: unknown provider, or its plugin module declares none (exit code 4).
    """
    if name not in names():
        raise ProviderError(f"unknown provider {name!r}", hint=f"providers: {', '.join(names())}")
    module = settings.provider_plugins().get(name) or f"sftctl.providers.{name}"
    return _entry(name, module)


def provider_class(name: str) -> type[Any]:
    """The :class:`~sftctl.providers.base.Provider` class of ``name``, for what a class declares
    (``issubclass(provider_class(n), QueueEstimate)``) without making one."""
    e = entry(name)
    module = settings.provider_plugins().get(name) or f"sftctl.providers.{name}"
    return getattr(importlib.import_module(module), e.cls)


def install_hint(extra: str) -> str:
    """How to install an extra (its SDK), as the README installs sftctl: from its clone."""
    return f"pip install -e '.[{extra}]' in sftctl's clone"


def checked_class(name: str) -> type[Any]:
    """:func:`provider_class` once its SDK is known to be here.

    Raises:
        ProviderError: unknown provider, or its SDK is not installed (exit code 4).
    """
    e = entry(name)
    missing = sdk_missing(name)
    if missing is not None:
        raise ProviderError(missing, hint=install_hint(e.extra or name))
    try:
        return provider_class(name)
    except ModuleNotFoundError as err:
        if e.sdk and err.name and e.sdk.startswith(err.name.split(".")[0]):
            raise ProviderError(f"{name}: its SDK is not installed ({err.name})",
                                hint=install_hint(e.extra or name)) from None
        raise


def get_provider(name: str, **kwargs) -> Provider:
    """The provider called ``name``; ``kwargs`` go to its constructor (e.g. ``channel``).

    Raises:
        ProviderError: unknown provider, or its SDK is not installed (exit code 4).
    """
    return checked_class(name)(**kwargs)


def sdk_missing(name: str) -> str | None:
    """None when ``name``'s SDK can be imported here (or it needs none), else one line saying
    which is missing (:func:`install_hint` says how to install it). Looks the module up without importing it."""
    sdk = entry(name).sdk
    if sdk is None:
        return None
    try:
        found = importlib.util.find_spec(sdk) is not None
    except (ImportError, ValueError):  # a parent package is missing, or a stub without a spec
        found = False
    if found:
        return None
    return f"{name}: its SDK ({sdk}) is not installed"


def configured(name: str, environ: Mapping[str, str] | None = None) -> str | None:
    """None when ``name`` has credentials where its SDK looks for them, else why not (one line).

    No network call and no SDK import: this is what ``sftctl plan`` and ``run`` use to rule a
    cloud out quickly. Each provider's ``PROVIDER.configured`` says how (boto3's credential
    chain, Google's Application Default Credentials, kubeconfig / in-cluster, a Slurm login node).
    """
    try:
        e = entry(name)
    except ProviderError as err:  # unknown, or a plugin that cannot be imported: a reason
        return err.message
    return e.configured(environ)


def usable_providers() -> dict[str, str | None]:
    """Each provider name mapped to None if it looks usable here, else the reason it is not."""
    out: dict[str, str | None] = {}
    for name in names():
        why = configured(name)
        if why is None and sdk_missing(name):
            why = f"{sdk_missing(name)} ({install_hint(entry(name).extra or name)})"
        if why is None and capabilities(name).local_admission:
            try:  # its nodes run on this machine: whether they can is known here, at once
                get_provider(name).check()
            except Exception as e:  # noqa: BLE001 a provider that cannot be used is a reason, not a crash
                why = getattr(e, "message", str(e))
        out[name] = why
    return out
