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

The teardown itself may fail after the work is done: a peer that already left makes the barrier
raise (gloo: "Connection closed by peer"), NCCL's destroy can raise. Raised out of
:func:`finish`, that was a traceback and an interpreter finalizing with gloo's threads alive
(the abort above); now it is one line on stderr (``sftctl.train.finish: ...``) and the exit
code :data:`TEARDOWN_FAILED` (the script's own ``exit_code`` if that is non-zero). The
controller counts a node that exits non-zero after every rank's last step and the final
checkpoint as finished, with a ``teardown_exit`` warning event (sftctl/controller/lifecycle.py).
"""

from __future__ import annotations

import atexit
import os
import sys

#: the exit code of a process whose process-group teardown (barrier, destroy) raised
TEARDOWN_FAILED = 1


def finish(exit_code: int = 0) -> None:
    """End a training process cleanly; call it on every rank once training and the last
    checkpoint are done (it is collective when a process group is initialized). Does not
    return.

    1. With a process group: ``dist.barrier()`` (every rank got here) and
       ``dist.destroy_process_group()``. When either raises (a peer gone, a backend's destroy
       error), one line ``sftctl.train.finish: process group teardown failed after training:
       <error>`` goes to stderr and the exit code becomes :data:`TEARDOWN_FAILED` (unless
       ``exit_code`` is non-zero already); steps 2 and 3 still run.
    2. Python's ``atexit`` handlers run (logging flushed, executors joined), ``sys.stdout`` and
       ``sys.stderr`` are flushed.
    3. ``os._exit`` with that code: the process ends without interpreter finalization, which torch's
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
    code = int(exit_code)
    dist = sys.modules.get("torch.distributed")
    try:
        if dist is not None and dist.is_available() and dist.is_initialized():
            dist.barrier()
            dist.destroy_process_group()
    except (RuntimeError, OSError) as e:  # torch.distributed.DistError is a RuntimeError: one line
        first = str(e).strip().splitlines()[0] if str(e).strip() else ""
        print(f"sftctl.train.finish: process group teardown failed after training: {type(e).__name__}"
              + (f": {first}" if first else ""), file=sys.stderr, flush=True)
        code = code or TEARDOWN_FAILED
    try:
        atexit._run_exitfuncs()
    finally:
        for stream in (sys.stdout, sys.stderr):
            try:
                if stream is not None:
                    stream.flush()
            except (OSError, ValueError):  # a closed pipe or file: nothing left to flush
                pass
        os._exit(code)
