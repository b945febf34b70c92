"""The state's GPU series (issue 36): each node's health-agent samples as they arrive, thinned
into min/max buckets as they age (state.GPU_TIERS), on SQLite and on a real Postgres."""

from __future__ import annotations

import json
from pathlib import Path

from sftctl.state import GPU_TIERS, Store

FIXTURES = Path(__file__).parent / "fixtures"


def _sample(ts: float, gpu: int = 0, util: int = 99, temp: int = 60, xids=(), **kw) -> dict:
    return {"ts": ts, "gpu": gpu, "utilization_gpu_pct": util, "temperature_gpu_c": temp, "clock_sm_mhz": 1980,
            "power_usage_mw": 650_000, "memory_used_mib": 70_000, "ecc_uncorrected_volatile": 0,
            "xids": list(xids), **kw}


def test_gpu_samples_are_kept_whole_then_thinned_to_min_max_buckets(state_backend):
    store = Store()
    job = store.create_job("demo", {})
    t0 = 1_000_000.0 * 60  # a whole minute
    # a real agent stream first: tests/fixtures/xid79.jsonl (its XID record counted)
    records = [json.loads(line) for line in (FIXTURES / "xid79.jsonl").read_text().splitlines() if line]
    records = [{k: v for k, v in r.items() if k != "at_step"} for r in records if "gpu" in r]
    store.record_gpu_samples(job, 1, [dict(r, ts=t0 + i) for i, r in enumerate(records)], now=t0 + len(records))
    kept = store.gpu_series(job, node_rank=1)
    assert len(kept) == len(records) and all(p.span_s == 0 and p.n == 1 for p in kept)
    assert sum(p.xids for p in kept) == sum(len(r.get("xids") or ()) for r in records) > 0
    assert kept[0].temp_c_min == kept[0].temp_c_max == records[0]["temperature_gpu_c"]
    assert kept[0].power_w_max == records[0]["power_usage_mw"] / 1000

    # node 0, two GPUs, one sample a second for 2 hours: the older hour becomes minute buckets
    store2 = Store()  # a fresh store thins at its first write
    samples = [_sample(t0 + s, gpu=g, util=50 + s % 50, temp=40 + (s % 7), xids=[79] if s == 100 and g == 1 else ())
               for s in range(7200) for g in (0, 1)]
    store2.record_gpu_samples(job, 0, samples, now=t0 + 7200)
    points = store2.gpu_series(job, node_rank=0)
    edge = t0 + 7200 - GPU_TIERS[0][0]
    old = [p for p in points if p.ts < edge]
    recent = [p for p in points if p.ts >= edge]
    assert len(recent) == 2 * 3600 and all(p.span_s == 0 for p in recent)
    assert len(old) == 2 * 60 and all(p.span_s == 60 and p.n == 60 for p in old)
    first = next(p for p in old if p.gpu == 0)
    assert (first.ts, first.util_pct_min, first.util_pct_max, first.temp_c_min, first.temp_c_max) == (t0, 50, 99, 40, 46)
    assert sum(p.xids for p in old) == 1 and next(p for p in old if p.xids).gpu == 1
    assert sum(p.n for p in points) == len(samples)  # every sample is in exactly one point
    assert store.gpu_series(job, node_rank=1) == kept  # another node's series untouched
    assert len(store.gpu_series(job)) == len(points) + len(kept)


def test_a_week_of_gpu_samples_stays_bounded(home):
    """A simulated 7-day job, one sample a second: <= 20,000 points per GPU (issue 36)."""
    store = Store()
    job = store.create_job("week", {})
    t0 = 1_000_000.0 * 600
    hour = 3600
    for h in range(7 * 24):
        start = t0 + h * hour
        store._gpu_compacted.clear()  # thin every simulated hour (a controller: every minute)
        store.record_gpu_samples(job, 0, [_sample(start + s) for s in range(hour)], now=start + hour)
    points = store.gpu_series(job)
    assert sum(p.n for p in points) == 7 * 24 * hour
    assert len(points) <= 20_000, len(points)
    assert len(points) <= hour + 7 * 24 * 60  # the newest hour whole, then one point a minute
    widths = sorted({p.span_s for p in points})
    assert widths == [0.0, 60.0]
