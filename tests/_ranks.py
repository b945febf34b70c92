"""Fork a CPU (gloo) run's ranks from one process, for the multi-process workers
(tests/parallel_train_worker.py, tests/ring_attention_worker.py).

The rendezvous is the caller's environment (WORLD_SIZE, MASTER_ADDR, MASTER_PORT, as
``torch.distributed.init_process_group``'s env:// reads it); each child gets its RANK and LOCAL_RANK.
"""

from __future__ import annotations

import os
import signal
import sys
import traceback
from collections.abc import Callable


def forked(world: int, rank_main: Callable[[], object]) -> int:
    """Fork ``world`` ranks from this process, which has imported torch (and what the ranks use)
    once: the children share them copy-on-write (on a busy 2-core machine 4 separate imports of
    torch cost more than the work). Each child runs ``rank_main()`` with RANK and LOCAL_RANK set
    to its rank (0 .. world-1) and exits 0, or 1 with its traceback on stderr. Returns the first
    non-zero child status (the other children, which would wait on that rank, are then killed),
    else 0."""
    pids = []
    for rank in range(world):
        pid = os.fork()
        if pid == 0:
            os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank))
            code = 0
            try:
                rank_main()
            except BaseException:  # noqa: BLE001 - the child reports and exits non-zero
                traceback.print_exc()
                code = 1
            finally:
                sys.stdout.flush()
                sys.stderr.flush()
                os._exit(code)
        pids.append(pid)
    status, left = 0, set(pids)
    while left:
        pid, st = os.wait()
        left.discard(pid)
        code = os.waitstatus_to_exitcode(st)
        if code and not status:  # a failed rank: the others would wait on it
            status = code
            for other in left:
                os.kill(other, signal.SIGKILL)
    return status
