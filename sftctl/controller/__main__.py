"""``python -m sftctl.controller JOB_ID``: the detached controller (see
:func:`sftctl.controller.lifecycle.main`)."""

import sys

from sftctl.controller.lifecycle import main

sys.exit(main())
