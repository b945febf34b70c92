"""Shared plumbing of the codegen launchers: kernel modules per execution mode, dtypes, caches.

Triton decides at *decoration* time (``@triton.jit``) whether a function becomes a compiled
``JITFunction`` or an ``InterpretedFunction`` for the CPU interpreter (triton 3.9 reads
``knobs.runtime.interpret`` / ``TRITON_INTERPRET`` inside ``triton.jit``; verified against
``triton/runtime/jit.py``), and a compiled kernel can only call compiled helpers. So each kernel
source file is loaded once per mode (:func:`kernel_module`) as its own module object, with the
knob forced on or off while it executes; the launchers pick the mode at *launch* time
(:func:`use_interpreter`): the interpreter when ``TRITON_INTERPRET`` is set or the tensors live
on the CPU, the compiler otherwise. :mod:`~sftctl.compiler.codegen.targets` always uses the
compiled mode.
"""

from __future__ import annotations

import hashlib
import importlib.util
import os
import sys
import threading
from pathlib import Path

KERNEL_DIR = Path(__file__).resolve().parent / "kernels"

_LOCK = threading.RLock()
_MODULES: dict[tuple[str, bool], object] = {}


def interpret_requested() -> bool:
    """Whether ``TRITON_INTERPRET`` (or ``triton.knobs.runtime.interpret``) is on right now."""
    import triton

    return bool(triton.knobs.runtime.interpret)


def use_interpreter(*tensors) -> bool:
    """The mode a launch runs in: interpreter if requested or if any tensor is on the CPU."""
    if interpret_requested():
        return True
    return any(t is not None and t.device.type == "cpu" for t in tensors)


def kernel_module(path: str | os.PathLike, interpret: bool):
    """The kernel source file at ``path`` imported with every ``@triton.jit`` in ``interpret`` mode.

    Each (file, mode) pair is its own module object (named after the file's hash and the mode),
    so compiled kernels only ever call compiled helpers and interpreted ones interpreted helpers.
    Thread-safe; modules are cached for the process.
    """
    path = Path(path).resolve()
    key = (str(path), bool(interpret))
    mod = _MODULES.get(key)
    if mod is not None:
        return mod
    import triton

    with _LOCK:
        mod = _MODULES.get(key)
        if mod is not None:
            return mod
        digest = hashlib.sha256(str(path).encode()).hexdigest()[:12]
        name = f"sftctl_codegen_{path.stem}_{digest}_{'interp' if interpret else 'jit'}"
        spec = importlib.util.spec_from_file_location(name, path)
        if spec is None or spec.loader is None:
            raise ImportError(f"cannot load kernel source {path}")
        mod = importlib.util.module_from_spec(spec)
        sys.modules[name] = mod  # inspect.getsource (used by triton.jit) looks modules up here
        try:
            with triton.knobs.runtime.scope():
                triton.knobs.runtime.interpret = bool(interpret)
                spec.loader.exec_module(mod)
        except BaseException:
            sys.modules.pop(name, None)
            raise
        _MODULES[key] = mod
        return mod


def builtin_kernels(stem: str, interpret: bool):
    """One of the package's kernel files (``kernels/<stem>.py``) in the given mode."""
    return kernel_module(KERNEL_DIR / f"{stem}.py", interpret)


def generated_dir() -> Path:
    """Directory for generated kernel sources: ``<compiler cache>/codegen/src`` (created).

    ``SFTCTL_CODEGEN_CACHE`` overrides it (tests, read-only homes).
    """
    from sftctl import settings

    env = settings.get("SFTCTL_CODEGEN_CACHE")
    if env:
        d = Path(env).expanduser()
    else:
        from sftctl.compiler.cache import cache_dir

        d = cache_dir() / "codegen" / "src"
    d.mkdir(parents=True, exist_ok=True)
    return d


def write_source(path: Path, text: str) -> Path:
    """Write ``text`` to ``path`` atomically unless an identical file is already there."""
    if path.exists():
        try:
            if path.read_text() == text:
                return path
        except OSError:
            pass
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(path.suffix + f".tmp-{os.getpid()}-{threading.get_ident()}")
    tmp.write_text(text)
    os.replace(tmp, path)
    return path


# --------------------------------------------------------------------------------------------
# dtypes

#: torch dtype name -> (triton type string used in signatures, bytes)
TORCH_TO_TRITON = {
    "float32": "fp32", "float16": "fp16", "bfloat16": "bf16", "float64": "fp64",
    "int64": "i64", "int32": "i32", "int16": "i16", "int8": "i8", "uint8": "u8", "bool": "i1",
}


def dtype_name(dtype) -> str:
    """``torch.bfloat16`` / ``"bfloat16"`` / ``"bf16"`` -> ``"bfloat16"``.

    Raises:
        TypeError: a dtype the kernels do not handle.
    """
    s = str(dtype).replace("torch.", "")
    s = {"bf16": "bfloat16", "fp16": "float16", "half": "float16", "fp32": "float32",
         "float": "float32", "fp64": "float64", "double": "float64"}.get(s, s)
    if s not in TORCH_TO_TRITON:
        raise TypeError(f"unsupported dtype {dtype!r}; supported: {sorted(TORCH_TO_TRITON)}")
    return s


def triton_type(dtype) -> str:
    """Triton signature type of a scalar dtype (``"bf16"``)."""
    return TORCH_TO_TRITON[dtype_name(dtype)]


def torch_dtype(dtype):
    import torch

    return getattr(torch, dtype_name(dtype))


def tl_dtype(dtype):
    """The ``triton.language`` dtype object of ``dtype`` (for ``tl.constexpr`` dtype arguments)."""
    import triton.language as tl

    return {"float32": tl.float32, "float16": tl.float16, "bfloat16": tl.bfloat16,
            "float64": tl.float64, "int64": tl.int64, "int32": tl.int32, "int16": tl.int16,
            "int8": tl.int8, "uint8": tl.uint8, "bool": tl.int1}[dtype_name(dtype)]


def next_power_of_2(n: int) -> int:
    return 1 if n <= 1 else 1 << (int(n) - 1).bit_length()


def is_power_of_2(n: int) -> bool:
    return isinstance(n, int) and n > 0 and n & (n - 1) == 0


def with_overrides(defaults: dict, config: dict | None, what: str) -> dict:
    """A schedule: a copy of ``defaults`` with the keys of ``config`` (None: none) replaced.

    Raises:
        ValueError: ``config`` has a key ``defaults`` lacks: ``<what>: unknown keys [...]; known:
            [...]`` (the one rule of the GEMM, row and column-sum configs).
    """
    cfg = dict(defaults)
    if config:
        unknown = set(config) - set(cfg)
        if unknown:
            raise ValueError(f"{what}: unknown keys {sorted(unknown)}; known: {sorted(cfg)}")
        cfg.update(config)
    return cfg


def check_device(*tensors) -> None:
    """All tensors on one device.

    Raises:
        ValueError: tensors on different devices.
    """
    devs = {t.device for t in tensors if t is not None}
    if len(devs) > 1:
        raise ValueError(f"tensors on different devices: {sorted(map(str, devs))}")
