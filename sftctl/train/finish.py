"""The end of a training script: :func:`finish` (every rank: barrier, destroy the process group,
flush, exit 0) so torch's gloo teardown cannot abort a run that trained and checkpointed.

Why it exists (a core dump of the abort, torch 2.13 CPU, gloo, 2 ranks): after
``dist.destroy_process_group()`` the gloo backend keeps its worker threads (``pt_gloo_runloop``;
``ProcessGroupGloo`` has no ``shutdown``, its destructor joins them) as long as anything holds
the process group, and FSDP2's ``DeviceMesh`` (``_pg_registry``, kept by the model's DTensors and
DTensor's planner caches) holds it until interpreter finalization. A worker thread drops the last
work it ran (a barrier's work holds the collectives before it, with tensors Python created)
just after waking the main thread; under load that drop lands while the interpreter finalizes:
``decref_pyobject`` takes the GIL, CPython ends a thread that takes the GIL during finalization
with ``pthread_exit``, and the forced unwind through the work's ``noexcept`` destructor calls
``std::terminate``: "terminate called without an active exception", SIGABRT, exit -6 (the
backtrace: ``runLoop`` > ``~AsyncBarrierWork`` > ``~AsyncAllgatherWork`` >
``TensorImpl::decref_pyobject`` > ``gil_scoped_acquire`` > ``take_gil`` >
``PyThread_exit_thread``). The same class of abort is pytorch/pytorch#190489 (a process group
not destroyed) and the reason of the abandoned pytorch/pytorch PR 179291.

So the process must not finalize while gloo's threads may still release work: :func:`finish`
runs the ``atexit`` handlers (logging, thread pools) and flushes ``stdout``/``stderr`` while
the interpreter is whole, then ends the process with ``os._exit`` (no finalization, nothing
left for a worker thread to race).
"""

from __future__ import annotations

import atexit
import os
import sys


def finish(exit_code: int = 0) -> None:
    """End a training process cleanly; call it on every rank once training and the last
    checkpoint are done (it is collective when a process group is initialized). Does not
    return.

    1. With a process group: ``dist.barrier()`` (every rank got here) and
       ``dist.destroy_process_group()``.
    2. Python's ``atexit`` handlers run (logging flushed, executors joined), ``sys.stdout`` and
       ``sys.stderr`` are flushed.
    3. ``os._exit(exit_code)``: the process ends without interpreter finalization, which torch's
       gloo worker threads can race into an abort (see the module docstring).

    Outside ``torchrun`` (no process group) steps 2 and 3 only. Files a script opened and did not
    close are not flushed by finalization any more: close them (``with``) before.

    Args:
        exit_code: the process's exit status, 0 to 255.
    Raises:
        ValueError: ``exit_code`` outside 0..255 (before anything is torn down).
    """
    if not 0 <= int(exit_code) <= 255:
        raise ValueError(f"finish: exit_code must be 0..255, got {exit_code!r}")
    dist = sys.modules.get("torch.distributed")
    if dist is not None and dist.is_available() and dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()
    try:
        atexit._run_exitfuncs()
    finally:
        for stream in (sys.stdout, sys.stderr):
            try:
                if stream is not None:
                    stream.flush()
            except (OSError, ValueError):  # a closed pipe or file: nothing left to flush
                pass
        os._exit(int(exit_code))
