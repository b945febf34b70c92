"""Measured runs from elsewhere into the run history (issue 35, item 2): ``sftctl calibrate
import``'s JSON Lines (:func:`read_import`: checked whole before anything is predicted or stored;
:class:`ImportError_` names FILE:LINE, exit 2), a ``calibrate export`` read back
(:func:`read_exported`), the rows a server is sent (:func:`check_rows`), each record's model
prediction (:func:`predict_record`, the compiler api imported inside), the runs already there
(:func:`not_present`) and ``calibrate show``'s table (:func:`summary`). The calibration itself is
:mod:`sftctl.history`'s."""

from __future__ import annotations

import json
import math
import os
import statistics
import time
from pathlib import Path
from typing import Any

from sftctl.compiler.accuracy import factor as error_factor
from sftctl.errors import SpecError
from sftctl.history import kernel_mix
from sftctl.types import RunRecord


_NATIVE = {"spec", "accelerator", "gpus_per_node", "nodes", "measured_step_s", "mode", "provider", "instance_type",
           "region", "source"}
_PUBLISHED_NEEDS = ("entrypoint", "gpu", "batch_per_gpu", "dtype", "gpus_per_node", "nodes")


def _seconds_problem(key: str, v: Any) -> str | None:
    """What is wrong with ``v`` as field ``key``'s positive, finite number of seconds (a JSON
    number), in words for an error line; None when nothing is. An integer too large for a float
    (1e400 written out) is named by its digits, not printed whole."""
    if isinstance(v, int) and not isinstance(v, bool) and abs(v) > 1e300:
        return f"{key} is too large a number ({len(str(abs(v)))} digits); seconds are a number such as 0.52"
    if not isinstance(v, (int, float)) or isinstance(v, bool) or not 0 < float(v) < math.inf:
        return f"{key} must be a positive number of seconds, not {v!r}"
    return None


class ImportError_(SpecError):  # noqa: N801 - not the builtin
    """A line of an import file is not a measured run (exit 2); nothing of the file is imported."""


def _line_error(path: Path, no: int):
    """A maker of ``path:no: what`` import errors (exit 2; nothing of the file is imported)."""
    def bad(what: str) -> ImportError_:
        return ImportError_(f"{path}:{no}: {what}", hint="nothing of the file was imported; fix the line and import again")
    return bad


def _json_object(text: str, bad) -> dict:
    """One line of an import or export file as a JSON object.

    Raises:
        ImportError_: (``bad``'s) the line is not JSON, or not an object.
    """
    try:
        d = json.loads(text)
    except json.JSONDecodeError as e:
        raise bad(f"not JSON ({e.msg})") from None
    if not isinstance(d, dict):
        raise bad("not a JSON object")
    return d


def read_import(path: str | os.PathLike[str]) -> list[dict]:
    """Read and check ``path`` (JSON Lines, one measured run per line; blank lines and lines
    starting with ``#`` skipped) without predicting anything. Each record comes back normalised:
    ``{"line", "kind": "spec" | "published", "accelerator", "gpus_per_node", "nodes",
    "measured_step_s", "mode", "provider", "instance_type", "region", "source", ...}`` with
    ``spec`` / ``entrypoint`` resolved against the file's directory.

    Two formats: ``{"spec": "job.yaml", "accelerator", "gpus_per_node", "nodes",
    "measured_step_s", optional "mode", "provider", "instance_type", "region", "source"}``; or
    ``benchmarks/published_steps.py``'s record (``entrypoint``, ``gpu``, ``batch_per_gpu``,
    ``dtype``, ``mode``, ``gpus_per_node``, ``nodes``, ``parallelism``, ``checkpointing``,
    ``measured_step_s`` or ``seq_len`` with ``tokens_per_s_per_gpu``, optional ``mma_dtype_map``,
    ``reduce_dtype`` (the dtype FSDP reduce-scatters gradients in, torch's MixedPrecision
    ``reduce_dtype``: ``float32`` by default, ``bfloat16``, ``float16``), ``name``; its ``source``
    is a citation, kept as ``citation``).

    Raises:
        ImportError_: the file is missing or empty, or a line is not such a record
            (``FILE:LINE: what``; exit 2).
    """
    from sftctl.catalog import accelerator_names

    p = Path(path)
    lines = _import_lines(p)
    known = {n.lower(): n for n in accelerator_names()}
    out: list[dict] = []
    for no, raw in enumerate(lines, 1):
        text = raw.strip()
        if not text or text.startswith("#"):
            continue

        bad = _line_error(p, no)
        d = _json_object(text, bad)
        published = "spec" not in d
        if published:
            missing = [k for k in _PUBLISHED_NEEDS if k not in d]
            if missing:
                raise bad("missing " + ", ".join(missing) + " (a record needs spec, accelerator, gpus_per_node, nodes, "
                          "measured_step_s; or published_steps.py's entrypoint, gpu, batch_per_gpu, ...)")
        else:
            missing = [k for k in ("accelerator", "gpus_per_node", "nodes", "measured_step_s") if k not in d]
            if missing:
                raise bad("missing " + ", ".join(missing))
            unknown = sorted(set(d) - _NATIVE)
            if unknown:
                raise bad(f"unknown field {unknown[0]!r} (fields: {', '.join(sorted(_NATIVE))})")
        acc = d.get("accelerator") if not published else d.get("gpu")
        if not isinstance(acc, str) or acc.lower() not in known:
            raise bad(f"{'gpu' if published else 'accelerator'} {acc!r} is not in the catalog (sftctl catalog lists them)")
        for key in ("gpus_per_node", "nodes") + (("batch_per_gpu",) if published else ()):
            v = d.get(key)
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise bad(f"{key} must be a positive integer, not {v!r}")
        if "measured_step_s" in d:
            m = d["measured_step_s"]
        elif published and "tokens_per_s_per_gpu" in d and "seq_len" in d:
            try:
                m = d["batch_per_gpu"] * d["seq_len"] / d["tokens_per_s_per_gpu"]
            except (TypeError, ZeroDivisionError):
                m = None
        else:
            raise bad("missing measured_step_s (or seq_len and tokens_per_s_per_gpu)")
        problem = _seconds_problem("measured_step_s", m)
        if problem is not None:
            raise bad(problem)
        mode = d.get("mode")
        if mode is not None and mode not in ("eager", "default", "sftensor"):
            raise bad(f"mode {mode!r} is not one of eager, default, sftensor")
        for key in ("provider", "instance_type", "region", "source"):
            if key in d and not published and not isinstance(d[key], str):
                raise bad(f"{key} must be a string")
        rec = {"line": no, "kind": "published" if published else "spec", "accelerator": known[acc.lower()],
               "gpus_per_node": d["gpus_per_node"], "nodes": d["nodes"], "measured_step_s": float(m), "mode": mode,
               "provider": d.get("provider"), "instance_type": d.get("instance_type"), "region": d.get("region")}
        if published:
            entry = d["entrypoint"]
            if not isinstance(entry, str) or ":" not in entry:
                raise bad(f"entrypoint must be file.py:function, not {entry!r}")
            f = (p.parent / entry.split(":")[0])
            if not f.is_file():
                raise bad(f"entrypoint {entry}: no file {f} (paths are relative to the import file)")
            if d["dtype"] not in ("float32", "bfloat16", "float16"):
                raise bad(f"dtype {d['dtype']!r} is not one of float32, bfloat16, float16")
            ckpt = d.get("checkpointing", False)
            if not isinstance(ckpt, (bool, int, float)) or not 0 <= float(ckpt) <= 1:
                raise bad(f"checkpointing must be true, false or the fraction of blocks checkpointed, not {ckpt!r}")
            if d.get("reduce_dtype", "float32") not in ("float32", "bfloat16", "float16"):
                raise bad(f"reduce_dtype {d['reduce_dtype']!r} is not one of float32, bfloat16, float16")
            inter = d.get("inter_node_bytes_per_s")
            if inter is not None and (not isinstance(inter, (int, float)) or isinstance(inter, bool) or not inter > 0):
                raise bad(f"inter_node_bytes_per_s must be a positive number, not {inter!r}")
            rec |= {"entrypoint": entry, "workdir": str(p.parent), "batch_per_gpu": d["batch_per_gpu"],
                    "dtype": d["dtype"], "parallelism": d.get("parallelism", "ddp"), "checkpointing": float(ckpt),
                    "mma_dtype_map": d.get("mma_dtype_map"), "attention": d.get("attention", "auto"),
                    "torch": d.get("torch"), "inter_node_bytes_per_s": inter,
                    "reduce_dtype": d.get("reduce_dtype", "float32"),
                    "name": d.get("name") or entry, "source": p.stem, "citation": d.get("source")}
            if rec["parallelism"] not in ("ddp", "fsdp"):
                raise bad(f"parallelism {rec['parallelism']!r} is not ddp or fsdp")
            from sftctl.compiler.attention import IMPLEMENTATIONS

            if rec["attention"] not in IMPLEMENTATIONS:
                raise bad(f"attention {rec['attention']!r} is not one of {', '.join(IMPLEMENTATIONS)}")
            if rec["torch"] is not None and not (isinstance(rec["torch"], str)
                                                 and rec["torch"].count(".") == 1
                                                 and all(x.isdigit() for x in rec["torch"].split("."))):
                raise bad(f"torch must be a major.minor version such as \"2.4\", not {rec['torch']!r}")
        else:
            spec = d["spec"]
            if not isinstance(spec, str) or not (p.parent / spec).is_file():
                raise bad(f"spec {spec!r}: no such file (paths are relative to the import file)")
            rec |= {"spec": str(p.parent / spec), "source": d.get("source") or p.stem}
        out.append(rec)
    if not out:
        raise ImportError_(f"{p}: no records (one JSON object per line)", hint="sftctl calibrate import FILE.jsonl")
    return out


_EXPORTED_COLUMNS = ("accelerator", "count", "gpus_per_node", "nodes", "provider", "instance_type", "region", "mode",
                     "strategy", "predicted_step_s", "interval_low_s", "interval_high_s", "measured_step_s",
                     "measured_steps", "features", "name", "source_label", "ts")


def _import_lines(p: Path) -> list[str]:
    """The lines of import file ``p`` (UTF-8).

    Raises:
        ImportError_: ``p`` is a directory, missing, unreadable or not UTF-8 (exit 2).
    """
    hint = "sftctl calibrate import FILE.jsonl: a UTF-8 file of one JSON object per line"
    if p.is_dir():
        raise ImportError_(f"{p}: is a directory, not a JSON-lines file", hint=hint)
    if not p.is_file():
        raise ImportError_(f"{p}: no such file", hint=hint)
    try:
        return p.read_text(encoding="utf-8-sig").splitlines()  # a BOM (Windows editors) is no error
    except (OSError, UnicodeDecodeError) as e:
        why = e.strerror if isinstance(e, OSError) and e.strerror else str(e)
        raise ImportError_(f"{p}: cannot be read: {why}", hint=hint) from None


def read_exported(path: str | os.PathLike[str]) -> list[RunRecord] | None:
    """The rows of a ``calibrate export`` file (its first record has ``predicted_step_s``), ready
    to store as they are (``source`` ``imported``, ``job_id`` None: an import is never a job of
    this lab); None when ``path`` is not such a file (then :func:`read_import` reads it).

    Raises:
        ImportError_: a line of an export file is not an exported run (``FILE:LINE``; exit 2).
    """
    p = Path(path)
    if not p.is_file():
        return None
    lines = [(no, t.strip()) for no, t in enumerate(_import_lines(p), 1) if t.strip() and not t.strip().startswith("#")]
    try:
        first = json.loads(lines[0][1]) if lines else None
    except ValueError:
        return None
    if not isinstance(first, dict) or "predicted_step_s" not in first:
        return None
    rows = []
    for no, text in lines:
        bad = _line_error(p, no)
        d = _json_object(text, bad)
        for key in ("predicted_step_s", "measured_step_s"):
            problem = _seconds_problem(key, d.get(key))
            if problem is not None:
                raise bad(problem)
        if not isinstance(d.get("accelerator"), str) or not d["accelerator"]:
            raise bad("accelerator missing")
        for key in ("gpus_per_node", "nodes"):
            if not isinstance(d.get(key), int) or isinstance(d.get(key), bool) or d[key] < 1:
                raise bad(f"{key} must be a positive integer, not {d.get(key)!r}")
        row = {k: d.get(k) for k in _EXPORTED_COLUMNS}
        row["count"] = row["count"] or d["gpus_per_node"] * d["nodes"]
        if row["features"] is not None and not isinstance(row["features"], dict):
            raise bad("features must be an object")
        rows.append(RunRecord.from_dict(row | {"job_id": None, "source": "imported",
                                               "source_label": d.get("source_label") or p.stem,
                                               "ts": d.get("ts") or time.time()}))
    return rows


def check_rows(rows: Any) -> list[RunRecord]:
    """Imported rows as a server receives them (``POST /v1/calibrate/runs``): each a dict with
    accelerator, gpus_per_node, nodes, predicted_step_s and measured_step_s; stored as
    ``imported`` with no job id, whatever they say.

    Raises:
        SpecError: not a list of such rows (``runs[i]: what``; exit 2).
    """
    if not isinstance(rows, list) or not rows:
        raise SpecError("runs must be a non-empty list of run-history rows", hint="sftctl calibrate import FILE sends them")
    out = []
    for i, d in enumerate(rows):
        if not isinstance(d, dict):
            raise SpecError(f"runs[{i}]: not an object")
        for key in ("predicted_step_s", "measured_step_s"):
            problem = _seconds_problem(key, d.get(key))
            if problem is not None:
                raise SpecError(f"runs[{i}]: {problem}")
        for key in ("gpus_per_node", "nodes"):
            if not isinstance(d.get(key), int) or isinstance(d.get(key), bool) or d[key] < 1:
                raise SpecError(f"runs[{i}]: {key} must be a positive integer, not {d.get(key)!r}")
        if not isinstance(d.get("accelerator"), str) or not d["accelerator"]:
            raise SpecError(f"runs[{i}]: accelerator missing")
        if d.get("features") is not None and not isinstance(d["features"], dict):
            raise SpecError(f"runs[{i}]: features must be an object")
        row = {k: d.get(k) for k in _EXPORTED_COLUMNS}
        out.append(RunRecord.from_dict(row | {"count": row["count"] or d["gpus_per_node"] * d["nodes"], "job_id": None,
                                              "source": "imported",
                                              "source_label": str(d.get("source_label") or "imported"),
                                              "ts": d.get("ts") or time.time()}))
    return out


def predict_record(rec: dict, cache: dict | None = None) -> RunRecord:
    """The run-history row of one :func:`read_import` record: the model's prediction for it (the
    compiler, heavy: torch), its interval and kernel-time mix, with the measurement, ``source``
    ``imported`` and ``source_label`` the record's ``source``.

    Raises:
        SftctlError: the spec or entrypoint cannot be loaded, traced or compiled (the caller
            adds the file:line).
    """
    import sftctl.compiler.api as compiler
    from sftctl.catalog import cloud_offerings
    from sftctl.compiler.modes import COMPILE_TO_MODE
    from sftctl.planner import _Unsplittable, per_rank_batch

    cache = {} if cache is None else cache
    acc, gpn, nodes = rec["accelerator"], rec["gpus_per_node"], rec["nodes"]
    world = gpn * nodes
    if rec["kind"] == "spec":
        from sftctl.spec import load_spec

        spec = load_spec(rec["spec"])
        if spec.model is None:
            raise SpecError(f"{rec['spec']}: the spec has no model to predict")
        m = spec.model
        try:
            batch = per_rank_batch(m.batch_size, gpn, nodes)
        except _Unsplittable:
            raise SpecError(f"model.batch_size {m.batch_size} does not split over {world} GPUs") from None
        framework, entry, dtype = m.framework, m.entrypoint, m.dtype
        workdir = spec.workdir  # absolute after load_spec
        mode = rec["mode"] or ("default" if framework == "jax" else COMPILE_TO_MODE[spec.train.compile])
        t = spec.train
        parallelisms = ("ddp", "fsdp") if t.parallelism == "auto" else (t.parallelism,)
        checkpointing = (False, True) if t.activation_checkpointing is None else (t.activation_checkpointing,)
        precision, mma, name = m.matmul_precision, None, spec.name
        extra: dict[str, Any] = {"mask_fraction": m.mask_fraction, "expert_capacity": m.expert_capacity}
    else:
        framework, entry, dtype, batch, workdir = "torch", rec["entrypoint"], rec["dtype"], rec["batch_per_gpu"], rec["workdir"]
        mode = rec["mode"] or "eager"
        parallelisms, checkpointing = (rec["parallelism"],), (rec["checkpointing"] >= 1,)
        precision, mma, name, extra = "highest", rec["mma_dtype_map"], rec["name"], {}
    key = (framework, entry, workdir, batch, dtype, rec.get("attention"), rec.get("torch"))
    if key not in cache:
        from sftctl.compiler.attention import with_implementation

        graph = compiler.trace(framework, entry, workdir, batch, dtype, **extra)
        cache[key] = with_implementation(graph, rec.get("attention") or "auto", rec.get("torch"))
    target = compiler.load_target(acc)
    compiled = compiler.compile(cache[key], target, matmul_precision=precision, mma_dtype_map=mma)
    offering = next((o for o in cloud_offerings() if o.accelerator == acc and o.count == gpn
                     and (rec["provider"] is None or o.provider == rec["provider"])
                     and (rec["instance_type"] is None or o.instance_type == rec["instance_type"])), None)
    intra = offering.intra_node_bytes_per_s if offering else None
    inter = rec.get("inter_node_bytes_per_s") or (offering.inter_node_bytes_per_s if offering else None)

    def chosen(ckpt: tuple[bool, ...]):
        return compiler.predict(compiled, target, gpus_per_node=gpn, nodes=nodes, intra_node_bytes_per_s=intra,
                                inter_node_bytes_per_s=inter, mode=mode,
                                param_dtype_bytes=2 if dtype in ("bfloat16", "float16") else 4,
                                # a spec's job runs sftctl.train.prepare, which reduces in float32
                                reduce_dtype_bytes=2 if rec.get("reduce_dtype") in ("bfloat16", "float16") else 4,
                                parallelisms=parallelisms, checkpointing=ckpt,
                                provider=f"{rec['provider']}:{rec['instance_type']}" if rec["provider"]
                                else rec["provider"]).chosen

    ac = rec.get("checkpointing", 0.0) if rec["kind"] == "published" else 0.0
    if 0 < ac < 1:  # a fraction of the blocks checkpointed (published records): the mix of none and all
        parts = [(1 - ac, chosen((False,))), (ac, chosen((True,)))]
        ch = parts[1][1]
        step = sum(w * c.step_time_s for w, c in parts)
        comm_s = sum(w * c.comm_time_s for w, c in parts)
        strategy = f"{ch.parallelism}+ckpt{ac:g}"
    else:
        ch = chosen(checkpointing)
        step, comm_s = ch.step_time_s, ch.comm_time_s
        strategy = ch.parallelism + ("+ckpt" if ch.activation_checkpointing else "")
    comm = comm_s / step if step > 0 else 0.0
    f = error_factor(acc, comm)
    return RunRecord(
        job_id=None, accelerator=acc, count=world, gpus_per_node=gpn, nodes=nodes, provider=rec["provider"],
        instance_type=rec["instance_type"], region=rec["region"], mode=mode,
        strategy=strategy, predicted_step_s=step,
        interval_low_s=step / f, interval_high_s=step * f, measured_step_s=rec["measured_step_s"],
        features=kernel_mix(compiled.kernels, comm), name=name, source="imported", source_label=rec["source"],
        ts=time.time())


def import_file(path: str | os.PathLike[str], progress=None) -> list[RunRecord]:
    """Read, check and predict every record of ``path``: the rows to store, or an error naming
    the file:line (nothing is stored by this function; the caller stores all rows at once).

    Raises:
        ImportError_: a bad line, or a record whose model cannot be predicted (exit 2).
    """
    from sftctl.errors import SftctlError

    recs = read_import(path)
    cache: dict = {}
    rows = []
    for rec in recs:
        if progress:
            progress(f"predicting {path}:{rec['line']} ({rec['accelerator']}:{rec['gpus_per_node']} x{rec['nodes']})")
        try:
            rows.append(predict_record(rec, cache))
        except SftctlError as e:
            raise ImportError_(f"{path}:{rec['line']}: {e.message}",
                               hint="nothing of the file was imported; fix the line and import again") from None
        except (NotImplementedError, ValueError, KeyError) as e:
            raise ImportError_(f"{path}:{rec['line']}: cannot predict it: {type(e).__name__}: {e}",
                               hint="nothing of the file was imported; fix the line and import again") from None
    return rows


def _natural_key(r: RunRecord, with_ts: bool) -> tuple:
    """What makes a run-history row the same measurement whatever its source or row id: the
    offering and shape, the measured step (seconds) and, for an exported row, its ``ts`` (Unix
    seconds, kept by ``calibrate export``); for a record of a measurement file (no ``ts``: it is
    stamped when imported), its ``source_label`` and ``name`` instead."""
    where = (r.accelerator.lower(), r.gpus_per_node, r.nodes, r.mode, r.provider, r.instance_type, r.region,
             round(r.measured_step_s, 9))
    return (*where, round(r.ts, 3)) if with_ts else (*where, r.source_label, r.name)


def not_present(rows: list[RunRecord], existing: list[RunRecord], exported: bool) -> list[RunRecord]:
    """The ``rows`` of an import (:func:`import_file` or :func:`read_exported`: ``exported``) that
    are not already in the run history ``existing``, nor earlier in ``rows``: importing a file
    twice, or the export of this lab's own jobs, adds nothing (see :func:`_natural_key`)."""
    seen = {_natural_key(r, exported) for r in existing}
    out = []
    for r in rows:
        key = _natural_key(r, exported)
        if key not in seen:
            seen.add(key)
            out.append(r)
    return out


def summary(runs: list[RunRecord]) -> list[dict]:
    """``calibrate show``'s rows: per accelerator, offering (provider x instance type) and source,
    the runs, the median measured / predicted and its range."""
    groups: dict[tuple, list[RunRecord]] = {}
    for r in runs:
        groups.setdefault((r.accelerator, r.provider or "-", r.instance_type or "-", r.source), []).append(r)
    out = []
    for (acc, prov, inst, src), rs in sorted(groups.items()):
        ratios = [r.measured_step_s / r.predicted_step_s for r in rs]
        out.append({"accelerator": acc, "provider": prov, "instance_type": inst, "source": src, "runs": len(rs),
                    "labels": sorted({r.source_label or "-" for r in rs}),
                    "median_measured_over_predicted": statistics.median(ratios),
                    "min": min(ratios), "max": max(ratios)})
    return out
