"""How a failed trace of a job's model reads (:meth:`sftctl.planner.Predictor.graph`): one line
naming ``model.entrypoint`` and a fix, as the error class ``plan`` and ``run`` stop on.

- a file or function that is not there, or a file Python cannot parse: :class:`EntrypointError`
  (the user's mistake; it stops ``run`` as it stops ``plan``, exit 2);
- a framework module that is not installed: :class:`~sftctl.errors.SpecError`, naming the pip
  extra that installs it (:data:`_EXTRA_OF_MODULE`) when sftctl has one;
- another import error: :class:`~sftctl.errors.SpecError`;
- anything else the model's code or the tracer raised: :class:`~sftctl.errors.UntraceableModelError`
  (the model traced as far as the tracer could take it).
"""

from __future__ import annotations

from sftctl.compiler.frontends import EntrypointFileNotFound, EntrypointFunctionNotFound
from sftctl.errors import SftctlError, SpecError, UntraceableModelError

#: The pip extra that installs a framework the tracer imports (pyproject.toml's optional deps).
_EXTRA_OF_MODULE = {"torch": "torch", "jax": "jax", "jaxlib": "jax", "flax": "jax", "transformers": "hf"}


class EntrypointError(SpecError):
    """``model.entrypoint`` names a file or function that is not there, or a file Python cannot
    parse: the user's mistake. It stops ``run`` as it stops ``plan`` (exit 2); ranking by price
    only (``strict=False``) is for a framework that is not installed or a model sftctl cannot
    trace or compile."""


def trace_error(e: Exception, entrypoint: str) -> SftctlError:
    """The error to raise (from ``e``) when tracing ``entrypoint`` (``model.entrypoint``,
    ``file.py:function``) raised ``e``, in the process or in the sandboxed child
    (:mod:`sftctl.sandboxed_trace`, whose errors carry ``remote_type``): its message is
    ``model.entrypoint: ...`` with ``e``'s first line, its hint the fix (see the module docstring)."""
    first = str(e).splitlines()[0] if str(e) else ""
    hint = "sftctl compile --debug shows the traceback; leave model out to skip prediction"
    error: type[SftctlError] = SpecError
    if isinstance(e, (EntrypointFileNotFound, EntrypointFunctionNotFound, SyntaxError)):
        error = EntrypointError
        hint = "model.entrypoint is file.py:function, the file relative to workdir: check both names"
    extra = _EXTRA_OF_MODULE.get((getattr(e, "name", None) or "").split(".")[0])
    if isinstance(e, ModuleNotFoundError) and extra:
        hint = f"install it: pip install -e '.[{extra}]' in sftctl's clone (or leave model out to skip prediction)"
    elif error is SpecError and not isinstance(e, ImportError):
        error = UntraceableModelError  # the model traced as far as the tracer could take it
        hint = ("sftctl compile --debug shows the traceback; write that part with supported ops, "
                "or leave model out to skip prediction (sftctl run ranks by price)")
    what = f"cannot trace {entrypoint}: {getattr(e, 'remote_type', type(e).__name__)}: {first}"
    if isinstance(e, (EntrypointFileNotFound, EntrypointFunctionNotFound)):
        what = first  # "examples/gpt/model.py has no function 'nofunc'"
    return error(f"model.entrypoint: {what}", hint=hint)
