"""Jinja2 templates for node bootstrap scripts (and, later, cloud user-data and manifests)."""

from __future__ import annotations

import shlex
from functools import lru_cache


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
    return env


def render(name: str, **context) -> str:
    """Render template ``name`` (e.g. ``node.sh.j2``); a missing variable raises an error."""
    return _env().get_template(name).render(**context)
