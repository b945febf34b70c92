"""``python tests/_signal_at_end.py SIGNAL sftctl-args...``: the real CLI (``sftctl.cli.main``),
which sends itself SIGNAL (``TERM``, ``INT`` or ``HUP``) the moment an attached job's controller
returns from :meth:`sftctl.controller.lifecycle.Controller.run`: its teardown is done and it has
given the signal handlers back, and ``sftctl run`` has not yet started printing the rest of the
job's output (``sftctl.cli.launch._finish_printing``). A signal there once killed the client
(exit -15) though its job had SUCCEEDED (tests/test_run_output.py). Says ``sent SIG... after the
controller returned`` on stderr when it sent it."""

from __future__ import annotations

import os
import signal
import sys

from sftctl.controller import lifecycle

SIGNAL = signal.Signals["SIG" + sys.argv[1]]
_run = lifecycle.Controller.run


def _run_then_signal(self):
    status = _run(self)
    os.write(2, f"sent {SIGNAL.name} after the controller returned\n".encode())
    os.kill(os.getpid(), SIGNAL)  # Python runs its handler at the next bytecode: here, inside api.attach
    return status


lifecycle.Controller.run = _run_then_signal  # type: ignore[method-assign]

if __name__ == "__main__":
    from sftctl.cli import main

    sys.argv = ["sftctl", *sys.argv[2:]]
    sys.exit(main())
