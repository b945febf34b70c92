"""``xid``: the XIDs a GPU reported, by NVIDIA's catalogue (:data:`XID_ACTIONS`): ``restart`` in
place or ``replace`` the node (failure code ``gpu_failed``)."""

from __future__ import annotations

from collections.abc import Iterable

from sftctl.health.detectors.common import ACTION_RANK as _ACTION_RANK, _by_gpu, _ts, per_node
from sftctl.health.registry import Detector, Threshold, register
from sftctl.health.telemetry import REPLACE, RESTART, Action, Thresholds, Verdict
from sftctl.types import FailureCode

# ---------------------------------------------------------------------------------------------
# XID action table
#
# From NVIDIA's "XID Errors" documentation (r555, https://docs.nvidia.com/deploy/xid-errors/,
# "Analyzing Xid Errors with the Xid Catalog": resolution buckets RESTART_APP / RESET_GPU /
# CONTACT_SUPPORT ...). Mapping used here: RESTART_APP -> ``restart``; anything that needs a GPU
# reset, a reboot or hardware service -> ``replace`` (sftctl has no root on the node to reset a
# GPU, so a reset is done as a node replacement); informational events -> no verdict.
# Application XIDs (usually a bug or bad input in the program, not the GPU) restart, unless the
# same XID repeats ``Thresholds.app_xid_repeats`` times on one GPU: then the GPU is suspect.
# ---------------------------------------------------------------------------------------------

#: XIDs caused by the application in the common case.
APP_XIDS = frozenset({13, 31, 43, 45})

#: XID -> (action or None for "informational, no verdict", short description)
XID_ACTIONS: dict[int, tuple[Action | None, str]] = {
    13: (RESTART, "graphics engine exception"),
    31: (RESTART, "GPU memory page fault"),
    43: (RESTART, "GPU stopped processing"),
    45: (RESTART, "preemptive cleanup, due to previous errors"),
    48: (REPLACE, "double-bit ECC error"),
    61: (REPLACE, "internal micro-controller breakpoint/warning"),
    62: (REPLACE, "internal micro-controller halt"),
    63: (None, "ECC page retirement or row remapping recording event"),
    64: (REPLACE, "ECC page retirement or row remapping recording failure"),
    74: (REPLACE, "NVLink error"),
    79: (REPLACE, "GPU has fallen off the bus"),
    92: (REPLACE, "high single-bit ECC error rate"),
    94: (RESTART, "contained ECC error"),
    95: (REPLACE, "uncontained ECC error"),
    119: (REPLACE, "GSP RPC timeout"),
    120: (REPLACE, "GSP error"),
}


def xid_verdicts(samples: Iterable[dict], node_rank: int, th: Thresholds) -> list[Verdict]:
    """One verdict per GPU that reported XIDs needing action; see :data:`XID_ACTIONS`.

    Each sample's ``xids`` lists the XIDs seen since the previous sample, so occurrences are
    counted over all samples given. An application XID (:data:`APP_XIDS`) seen
    ``th.app_xid_repeats`` times or more on one GPU (the same code) is ``replace``; fewer is
    ``restart``. Unknown XIDs are ``restart`` and say so. Informational XIDs (63) alone give no
    verdict. The GPU's verdict is the one of its most severe XID; the evidence lists the others.
    """
    out = []
    for gpu, lst in _by_gpu(samples).items():
        counts: dict[int, int] = {}
        last_ts: dict[int, float] = {}
        for s in lst:
            for x in s.get("xids") or ():
                x = int(x)
                counts[x] = counts.get(x, 0) + 1
                last_ts[x] = _ts(s)
        findings = []  # (action rank, -first-seen order, xid, action, text)
        for order, (xid, n) in enumerate(counts.items()):
            action, desc = XID_ACTIONS.get(xid, (RESTART, None))
            if action is None:
                continue
            if desc is None:
                text = f"XID {xid} seen {n}x, unknown to the action table (restart by default)"
            elif xid in APP_XIDS:
                if n >= th.app_xid_repeats:
                    action = REPLACE
                    text = (f"application XID {xid} ({desc}) seen {n}x on this GPU "
                            f"(>= {th.app_xid_repeats}: treated as a GPU fault)")
                else:
                    text = f"application XID {xid} ({desc}) seen {n}x"
            else:
                text = f"XID {xid} ({desc}) seen {n}x"
            findings.append((_ACTION_RANK[action], -order, xid, action, text))
        if not findings:
            continue
        findings.sort(reverse=True)
        _, _, xid, action, text = findings[0]
        others = sorted((f[2], counts[f[2]]) for f in findings[1:])
        info = sorted((x, n) for x, n in counts.items() if XID_ACTIONS.get(x, (RESTART,))[0] is None)
        extra = ", ".join(f"XID {x} x{n}" for x, n in others + info)
        evidence = f"GPU {gpu}: {text}" + (f"; also {extra}" if extra else "")
        out.append(Verdict(kind="xid", action=action, node_rank=node_rank, gpu=gpu,
                           evidence=evidence, ts=last_ts[xid]))
    return out


DETECTOR = register(Detector(
    kind="xid", code=FailureCode.GPU_FAILED, order=20, run=per_node(xid_verdicts),
    summary="a GPU reported an XID: restart in place or replace the node, by NVIDIA's catalogue",
    thresholds=(Threshold("app_xid_repeats", 2, "times", "times an application XID (13, 31, 43, 45) must "
                          "repeat on one GPU before it counts as hardware"),),
))
