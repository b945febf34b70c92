"""Providers turn offerings into nodes. See :mod:`sftctl.providers.base` for the protocol.

Cloud SDKs are imported inside their provider module only; importing this package is cheap, and
so is :func:`usable_providers` (it looks for credentials where the SDKs look, without a network
call; ``sftctl check`` makes the real calls).
"""

from __future__ import annotations

import importlib
import importlib.util
import os
from pathlib import Path

from sftctl import settings
from sftctl.errors import ProviderError
from sftctl.providers.base import Provider

PROVIDERS = ("local", "aws", "gcp", "kubernetes", "slurm")

_CLASSES = {
    "local": ("sftctl.providers.local", "LocalProvider"),
    "aws": ("sftctl.providers.aws", "AWSProvider"),
    "gcp": ("sftctl.providers.gcp", "GCPProvider"),
    "kubernetes": ("sftctl.providers.kubernetes", "KubernetesProvider"),
    "slurm": ("sftctl.providers.slurm", "SlurmProvider"),
}

_SDKS = {"aws": "boto3", "gcp": "google.cloud.compute_v1", "kubernetes": "kubernetes"}
_EXTRAS = {"aws": "aws", "gcp": "gcp", "kubernetes": "kubernetes"}


def get_provider(name: str, **kwargs) -> Provider:
    """The provider called ``name``; ``kwargs`` go to its constructor (e.g. ``channel``).

    Raises:
        ProviderError: unknown provider, or its SDK is not installed (exit code 4).
    """
    if name not in _CLASSES:
        raise ProviderError(f"unknown provider {name!r}", hint=f"providers: {', '.join(PROVIDERS)}")
    module, cls = _CLASSES[name]
    missing = sdk_missing(name)
    if missing is not None:
        raise ProviderError(missing, hint=f"pip install 'sftctl[{_EXTRAS[name]}]'")
    try:
        mod = importlib.import_module(module)
    except ModuleNotFoundError as e:
        if name in _SDKS and e.name and _SDKS[name].startswith(e.name.split(".")[0]):
            raise ProviderError(
                f"{name}: its SDK is not installed ({e.name})",
                hint=f"pip install 'sftctl[{_EXTRAS[name]}]'",
            ) from None
        raise
    return getattr(mod, cls)(**kwargs)


def sdk_missing(name: str) -> str | None:
    """None when ``name``'s SDK can be imported here (or it needs none), else one line saying
    which is missing (``pip install 'sftctl[<name>]'`` installs it). Looks the module up without importing it."""
    sdk = _SDKS.get(name)
    if sdk is None:
        return None
    try:
        found = importlib.util.find_spec(sdk) is not None
    except (ImportError, ValueError):  # a parent package is missing, or a stub without a spec
        found = False
    if found:
        return None
    return f"{name}: its SDK ({sdk}) is not installed"


def configured(name: str, environ: dict | None = None) -> str | None:
    """None when ``name`` has credentials where its SDK looks for them, else why not (one line).

    No network call and no SDK import: this is what ``sftctl plan`` and ``run`` use to rule a
    cloud out quickly. Sources: boto3's credential chain (env, shared files, web identity,
    container credentials), Google's Application Default Credentials, kubeconfig / in-cluster.
    """
    env = os.environ if environ is None else environ
    home = Path(env.get("HOME", str(Path.home())))
    if name == "local":
        return None
    if name == "aws":
        if (env.get("AWS_ACCESS_KEY_ID") or env.get("AWS_PROFILE") or env.get("AWS_WEB_IDENTITY_TOKEN_FILE")
                or env.get("AWS_CONTAINER_CREDENTIALS_RELATIVE_URI") or env.get("AWS_CONTAINER_CREDENTIALS_FULL_URI")
                or Path(env.get("AWS_SHARED_CREDENTIALS_FILE", home / ".aws" / "credentials")).is_file()
                or Path(env.get("AWS_CONFIG_FILE", home / ".aws" / "config")).is_file()):
            return None
        return "aws: no credentials (set AWS_PROFILE or AWS_ACCESS_KEY_ID, or run aws configure)"
    if name == "gcp":
        adc = Path(env.get("CLOUDSDK_CONFIG", home / ".config" / "gcloud")) / "application_default_credentials.json"

        if env.get("GOOGLE_APPLICATION_CREDENTIALS") or settings.get("SFTCTL_GCE_ENDPOINT", environ) or adc.is_file():
            return None
        return "gcp: no credentials (run gcloud auth application-default login, or set GOOGLE_APPLICATION_CREDENTIALS)"
    if name == "kubernetes":
        paths = env.get("KUBECONFIG", str(home / ".kube" / "config")).split(os.pathsep)
        if env.get("KUBERNETES_SERVICE_HOST") or any(p and Path(p).is_file() for p in paths):
            return None
        return "kubernetes: no kubeconfig (set KUBECONFIG or create ~/.kube/config)"
    if name == "slurm":  # a login node (sinfo and a slurm.conf here) or slurm.host in the config
        from sftctl.providers.slurm import configured_reason

        return configured_reason(env)
    return f"unknown provider {name!r}"


def usable_providers() -> dict[str, str | None]:
    """Each provider name mapped to None if it looks usable here, else the reason it is not."""
    out: dict[str, str | None] = {}
    for name in PROVIDERS:
        why = configured(name)
        if why is None and sdk_missing(name):
            why = f"{sdk_missing(name)} (pip install 'sftctl[{_EXTRAS[name]}]')"
        if name == "local":
            try:
                get_provider("local").check()
            except Exception as e:  # a provider that cannot be used is a reason, not a crash
                why = getattr(e, "message", str(e))
        out[name] = why
    return out
