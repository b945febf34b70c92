"""Providers turn offerings into nodes. See :mod:`sftctl.providers.base` for the protocol.

Cloud SDKs are imported inside their provider module only; importing this package is cheap.
"""

from __future__ import annotations

from sftctl.providers.base import Provider

PROVIDERS = ("local", "aws", "gcp", "kubernetes")


def get_provider(name: str) -> Provider:
    """The provider called ``name``.

    Raises:
        ProviderError: the provider is not available in this build (exit code 4).
    """
    if name == "local":
        from sftctl.providers.local import LocalProvider

        return LocalProvider()
    from sftctl.errors import ProviderError

    raise ProviderError(
        f"provider {name!r} is not available in this version of sftctl",
        hint="use resources.clouds: [local], or wait for the cloud providers to land",
    )


def usable_providers() -> dict[str, str | None]:
    """Each provider name mapped to None if usable here, else the reason it is not."""
    out: dict[str, str | None] = {}
    for name in PROVIDERS:
        try:
            get_provider(name).check()
            out[name] = None
        except Exception as e:  # a provider that cannot be used is a reason, not a crash
            out[name] = getattr(e, "message", str(e))
    return out
