"""Append-only byte streams over object storage: how a cloud node's logs, metrics and GPU samples
reach the controller (a node has no port the controller could connect to).

A stream is a key prefix holding numbered, immutable segments::

    nodes/<node id>/node.log/0000000000
    nodes/<node id>/node.log/0000000001         ...

whose concatenation is the stream. The node side, :class:`StreamWriter`, buffers appended bytes
and writes the buffer as the next segment when it reaches ``flush_bytes`` (256 KiB), when its
oldest byte has waited ``flush_interval_s`` (2 s), and on ``flush``/``close``. A failed segment
write keeps the buffer and retries the same sequence number, so the stream never has a gap or a
duplicate. The controller side, :class:`StreamReader`, reads the concatenation from a byte
offset, listing only keys after the last segment it has seen.

:class:`NodeChannel` is the node protocol's storage I/O (launch, ack, stop, exit and failure
objects, and the streams' readers): the controller's providers hold one end, the node daemon and
the shipper the other. :mod:`sftctl.protocol` names every object and states the rules; it does no
storage I/O itself.

:class:`Shipper` runs on a node: it tails the node directory's files (names and
rules: :mod:`sftctl.protocol`: ``node.log``, ``agent.log``, ``health.jsonl``,
``metrics/rank-*.jsonl``) into the streams ``nodes/<node id>/<relative path>`` (byte offsets in
a stream equal offsets in the file), and ships each exit file as the protocol's exit object
after flushing every stream (its rule 2), just after the attempt's failure record when there is
one, so a controller that sees the exit code has every log byte the attempt wrote and why it
failed. A restarted shipper continues each stream after
the bytes already there.

Run it from a node's bootstrap::

    python -m sftctl.storage.stream --storage s3://bucket/prefix --node-id N --node-dir DIR

It ships every ``--interval`` seconds (default 1) until SIGTERM/SIGINT, then ships what is left.
"""

from __future__ import annotations

import json
import os
import re
import sys
import threading
import time
from pathlib import Path
from typing import Callable, Mapping

from sftctl import protocol, settings
from sftctl.protocol import node_prefix
from sftctl.storage import Storage, StorageError, StorageNotFound, open_storage

__all__ = [
    "FLUSH_BYTES",
    "FLUSH_INTERVAL_S",
    "Shipper",
    "StreamReader",
    "StreamWriter",
    "node_prefix",
    "read_json_lines",
    "segment_key",
]

#: A segment is written once this many bytes are buffered.
FLUSH_BYTES = 256 * 1024
#: ... or once the oldest buffered byte has waited this long (seconds).
FLUSH_INTERVAL_S = 2.0
#: The largest segment written; a bigger buffer is split.
MAX_SEGMENT_BYTES = 8 * 1024 * 1024
#: How much a reader returns at most per ``read`` call by default.
READ_MAX_BYTES = 8 * 1024 * 1024

_SEQ_RE = re.compile(r"^\d{10}$")


def segment_key(prefix: str, seq: int) -> str:
    """The key of segment ``seq`` of the stream ``prefix``: ``<prefix>/<seq:010d>``."""
    return f"{prefix.rstrip('/')}/{seq:010d}"


def _segments(storage: Storage, prefix: str, start_after: str | None = None) -> list[tuple[int, str, int]]:
    """``[(seq, key, size)]`` of the stream's segments (after ``start_after``), by seq."""
    out = []
    base = prefix.rstrip("/") + "/"
    for key, size in storage.list(base, start_after=start_after):
        name = key[len(base):]
        if _SEQ_RE.match(name):
            out.append((int(name), key, size))
    out.sort()
    return out


class StreamWriter:
    """The node side of a stream: ``write`` bytes, segments appear as ``<prefix>/<seq:010d>``.

    Opening lists the stream once and continues after its last segment (``shipped_bytes`` is
    then the stream's length), so a restarted writer appends rather than overwrites.
    Thread-safe.

    Args:
        storage: the job's storage.
        prefix: the stream's key prefix, e.g. ``nodes/n1/node.log``.
        flush_bytes: write a segment once this many bytes are buffered.
        flush_interval_s: ... or once the oldest buffered byte is this old (checked by ``write``
            and ``poll``; call ``poll`` periodically when writes are rare).
        clock: monotonic seconds (tests pass a fake one).
    """

    def __init__(self, storage: Storage, prefix: str, *, flush_bytes: int = FLUSH_BYTES,
                 flush_interval_s: float = FLUSH_INTERVAL_S, clock: Callable[[], float] = time.monotonic):
        self.storage = storage
        self.prefix = prefix.rstrip("/")
        self.flush_bytes = flush_bytes
        self.flush_interval_s = flush_interval_s
        self.clock = clock
        existing = _segments(storage, self.prefix)
        self.next_seq = existing[-1][0] + 1 if existing else 0
        self.shipped_bytes = sum(size for _, _, size in existing)
        self._buf = bytearray()
        self._oldest: float | None = None
        self._lock = threading.Lock()
        self.closed = False

    @property
    def total_bytes(self) -> int:
        """Bytes written to this stream so far, shipped or buffered."""
        return self.shipped_bytes + len(self._buf)

    def write(self, data: bytes) -> None:
        """Append ``data``; writes segments when a flush is due.

        Raises:
            StorageError: a due segment could not be written (the bytes stay buffered; the next
                ``write``/``poll``/``flush`` retries).
            ValueError: the writer is closed.
        """
        if not data:
            return
        with self._lock:
            if self.closed:
                raise ValueError(f"stream {self.prefix} is closed")
            if self._oldest is None:
                self._oldest = self.clock()
            self._buf += data
            if self._due():
                self._flush_locked()

    def _due(self) -> bool:
        return bool(self._buf) and (len(self._buf) >= self.flush_bytes or
                                    self.clock() - (self._oldest or 0.0) >= self.flush_interval_s)

    def poll(self) -> bool:
        """Write the buffer if a flush is due by size or age; return whether a segment was written."""
        with self._lock:
            if self._due():
                self._flush_locked()
                return True
            return False

    def flush(self) -> None:
        """Write everything buffered as segments now (nothing when the buffer is empty)."""
        with self._lock:
            self._flush_locked()

    def _flush_locked(self) -> None:
        while self._buf:
            chunk = bytes(self._buf[:MAX_SEGMENT_BYTES])
            self.storage.put_bytes(segment_key(self.prefix, self.next_seq), chunk)
            self.next_seq += 1
            self.shipped_bytes += len(chunk)
            del self._buf[:len(chunk)]
        self._oldest = None

    def close(self) -> None:
        """Flush and refuse further writes. Idempotent."""
        with self._lock:
            self._flush_locked()
            self.closed = True

    def __enter__(self) -> "StreamWriter":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class StreamReader:
    """The controller side of a stream: ``read(offset) -> (bytes, next offset)``.

    Keeps the segment index it has seen and lists only keys after the last one; a segment is
    immutable once written, so the last one fetched is cached (a reader that waits for the end of
    a line re-reads the tail without another request). Segments are taken in sequence order only:
    should a listing show a gap, the reader stops before it until the missing one appears.
    """

    def __init__(self, storage: Storage, prefix: str):
        self.storage = storage
        self.prefix = prefix.rstrip("/")
        self._index: list[tuple[int, str, int]] = []  # (start offset, key, size)
        self._end = 0
        self._next_seq = 0
        self._cache: tuple[str, bytes] | None = None

    @property
    def known_bytes(self) -> int:
        """The stream's length as of the last listing."""
        return self._end

    def refresh(self) -> int:
        """List new segments; return the stream's known length."""
        last = self._index[-1][1] if self._index else None
        for seq, key, size in _segments(self.storage, self.prefix, start_after=last):
            if seq != self._next_seq:
                break  # a gap (or a segment listed twice): wait for the listing to catch up
            self._index.append((self._end, key, size))
            self._end += size
            self._next_seq += 1
        return self._end

    def _segment(self, key: str) -> bytes:
        if self._cache is not None and self._cache[0] == key:
            return self._cache[1]
        data = self.storage.get_bytes(key)
        self._cache = (key, data)
        return data

    def read(self, offset: int = 0, max_bytes: int = READ_MAX_BYTES) -> tuple[bytes, int]:
        """The stream's bytes from ``offset``: ``(data, offset + len(data))``.

        Returns at most about ``max_bytes`` (whole segments, at least the rest of the one holding
        ``offset``); ``b""`` when there is nothing new. An offset past the known end returns
        ``(b"", offset)``.
        """
        if offset < 0:
            raise ValueError(f"offset must be >= 0, got {offset}")
        if self._end - offset < max_bytes:  # what is known does not fill the answer: list new segments
            self.refresh()
        if offset >= self._end:
            return b"", offset
        # the first segment holding offset (binary search over start offsets)
        lo, hi = 0, len(self._index) - 1
        while lo < hi:
            mid = (lo + hi + 1) // 2
            if self._index[mid][0] <= offset:
                lo = mid
            else:
                hi = mid - 1
        parts: list[bytes] = []
        n = 0
        for start, key, size in self._index[lo:]:
            if n and n + size > max_bytes:
                break
            try:
                data = self._segment(key)
            except StorageNotFound:  # deleted under us (the job's storage was purged)
                break
            piece = data[offset - start:] if start < offset else data
            parts.append(piece)
            n += len(piece)
            offset = start + len(data)
        return b"".join(parts), offset


def read_json_lines(reader: StreamReader, offsets: dict[str, int], key: str) -> list[dict]:
    """Complete JSON lines of the stream after ``offsets[key]`` (advanced past them), parsed by
    :func:`sftctl.protocol.complete_json_lines`: a line still being written waits for its newline;
    lines that do not parse are skipped."""
    out: list[dict] = []
    while True:
        start = offsets.get(key, 0)
        data, end = reader.read(start)
        out += protocol.complete_json_lines(key, data, offsets)
        got = offsets[key] - start
        if not got or got < len(data) or end >= reader.known_bytes:
            break  # nothing new, the rest is a partial line, or everything listed was read
    return out


# --------------------------------------------------------------------------------------------
# the node side: tail a node directory into streams
# --------------------------------------------------------------------------------------------

#: Files of a node directory shipped as streams (``metrics/*.jsonl`` is added by glob).
TAILED_FILES = protocol.STREAMED_FILES
#: Read at most this much of one file per tick (a flood is shipped over several ticks).
TAIL_MAX_BYTES = 16 * 1024 * 1024


#: What ``poll_launch`` returns: ``(attempt, script, env)``.
LaunchRequest = tuple[int, str, dict[str, str]]


class NodeChannel:
    """Both ends of the node protocol over job storage (:mod:`sftctl.protocol`'s docstring is the
    specification: names, formats, ordering rules; this class is its storage I/O).

    The controller's provider calls :meth:`send_launch`, :meth:`acked`, :meth:`exit_code`,
    :meth:`request_stop` and the ``read_*`` methods; the node's daemon :meth:`poll_launch`,
    :meth:`ack` and :meth:`stop_requested`; its shipper :meth:`write_exit`. One object serves a
    whole job (every node); it keeps a stream reader per stream so each poll lists only new
    segments.

    Args:
        storage: the job's storage.
        secret_keys: names of environment variables whose values must never be stored (in
            addition to the names :func:`is_secret_name` recognizes).
    """

    def __init__(self, storage: Storage, secret_keys: set[str] | frozenset[str] = frozenset()):
        self.storage = storage
        self.secret_keys = frozenset(secret_keys)
        self._readers: dict = {}

    # ------------------------------------------------------------ keys
    @staticmethod
    def launch_key(node_id: str, attempt: int) -> str:
        return node_prefix(node_id) + protocol.launch_name(attempt)

    @staticmethod
    def ack_key(node_id: str, attempt: int) -> str:
        return node_prefix(node_id) + protocol.ack_name(attempt)

    @staticmethod
    def stop_key(node_id: str, attempt: int) -> str:
        return node_prefix(node_id) + protocol.stop_name(attempt)

    @staticmethod
    def exit_key(node_id: str, attempt: int) -> str:
        return node_prefix(node_id) + protocol.exit_name(attempt)

    @staticmethod
    def failure_key(node_id: str, attempt: int) -> str:
        return node_prefix(node_id) + protocol.failure_name(attempt)

    @staticmethod
    def stream_key(node_id: str, rel: str) -> str:
        """The stream of the node directory's file ``rel`` (``node.log``, ``metrics/rank-0.jsonl``)."""
        return node_prefix(node_id) + rel

    # ------------------------------------------------------------ controller side
    def send_launch(self, node_id: str, attempt: int, script: str, env: dict[str, str],
                    secret_keys: set[str] | frozenset[str] | None = None) -> str:
        """Write ``nodes/<node id>/launch-<attempt>.json`` holding the script and the env, with
        secret variables by name only (rule 7). Returns the key written.

        Raises:
            ValueError: ``attempt`` is negative.
            StorageError: the script contains the value of a secret variable (the message names
                the variable, never the value), or the write failed.
        """
        if attempt < 0:
            raise ValueError(f"attempt must be >= 0, got {attempt}")
        secret = self.secret_keys | frozenset(secret_keys or ())
        plain, names = {}, []
        for name, value in sorted(env.items()):
            if name in secret or protocol.is_secret_name(name):
                names.append(name)
            else:
                plain[name] = str(value)
        for name in names:  # a secret's value may not hide in the script or another variable
            value = str(env[name])
            if len(value) >= 8 and (value in script or any(value in v for v in plain.values())):
                raise StorageError(
                    f"launch of node {node_id}: the script or env contains the value of secret {name}; not storing it",
                    hint=f"refer to ${name} instead of its value", url=self.storage.url)
        doc = {"attempt": int(attempt), "script": script, "env": plain, "secret_env": names,
               "created_at": time.time()}
        key = self.launch_key(node_id, attempt)
        self.storage.put_bytes(key, json.dumps(doc, sort_keys=True).encode())
        return key

    def acked(self, node_id: str, attempt: int) -> bool:
        """Whether the node's daemon took ``attempt`` (``ack-<attempt>`` exists)."""
        return self.storage.exists(self.ack_key(node_id, attempt))

    def beat(self) -> None:
        """The controller watches the job: rewrite ``controller.heartbeat`` (unix time)."""
        self.storage.put_bytes(protocol.CONTROLLER_HEARTBEAT, f"{time.time():.3f}\n".encode())

    def heartbeat(self) -> bytes | None:
        """The controller's heartbeat as last written, or None when there is none (yet)."""
        try:
            return self.storage.get_bytes(protocol.CONTROLLER_HEARTBEAT)
        except StorageNotFound:
            return None

    def request_stop(self, node_id: str, attempt: int) -> None:
        """Ask the node's daemon to stop ``attempt`` (rule 5); the node stays."""
        self.storage.put_bytes(self.stop_key(node_id, attempt), b"")

    def exit_code(self, node_id: str, attempt: int) -> int | None:
        """The exit code of ``attempt`` on the node, or None while it has none (rule 2: its logs
        are all in storage once it has one)."""
        try:
            raw = self.storage.get_bytes(self.exit_key(node_id, attempt))
        except StorageNotFound:
            return None
        return protocol.parse_exit_code(raw)

    def read_failure(self, node_id: str, attempt: int):
        """Why ``attempt`` failed on the node (a :class:`sftctl.types.FailureReason`), or None
        when the node wrote no failure record (rule 2a)."""
        try:
            return protocol.parse_failure(self.storage.get_bytes(self.failure_key(node_id, attempt)))
        except StorageNotFound:
            return None

    def _reader(self, key: str):
        reader = self._readers.get(key)
        if reader is None:
            reader = self._readers[key] = StreamReader(self.storage, key)
        return reader

    def read_log(self, node_id: str, offset: int) -> tuple[bytes, int]:
        """``node.log`` bytes from ``offset``: ``(data, next offset)`` (offsets are the file's)."""
        return self._reader(self.stream_key(node_id, protocol.NODE_LOG)).read(offset)

    def read_agent_log(self, node_id: str, offset: int) -> tuple[bytes, int]:
        """``agent.log`` bytes from ``offset``, like :meth:`read_log`."""
        return self._reader(self.stream_key(node_id, protocol.AGENT_LOG)).read(offset)

    def read_metrics(self, node_id: str, offsets: dict[str, int]) -> list[dict]:
        """New complete JSON lines of every ``metrics/rank-*.jsonl`` stream of the node, rank
        files in name order; ``offsets`` (stream key -> offset) is advanced past them."""
        base = self.stream_key(node_id, protocol.METRICS_DIR + "/")
        out: list[dict] = []
        for name in self.storage.children(base):
            if name.endswith(".jsonl"):
                key = base + name
                out += read_json_lines(self._reader(key), offsets, key)
        return out

    def read_health(self, node_id: str, offsets: dict[str, int]) -> list[dict]:
        """New complete JSON lines of the node's ``health.jsonl`` stream (see :meth:`read_metrics`)."""
        key = self.stream_key(node_id, protocol.HEALTH_LOG)
        return read_json_lines(self._reader(key), offsets, key)

    def delete_node(self, node_id: str) -> int:
        """Delete everything of a node (after the job ends). Returns the objects deleted."""
        self._readers = {k: r for k, r in self._readers.items() if not k.startswith(node_prefix(node_id))}
        return self.storage.delete_prefix(node_prefix(node_id))

    # ------------------------------------------------------------ node side
    def poll_launch(self, node_id: str, after_attempt: int = 0,
                    environ: Mapping[str, str] | None = None) -> LaunchRequest | None:
        """The newest launch request of the node with an attempt above ``after_attempt`` (rule 4):
        ``(attempt, script, env)``, or None when there is none yet.

        ``env`` is the stored env plus each secret variable the request names, taken from
        ``environ`` (default ``os.environ``) where it is set there.
        """
        base = node_prefix(node_id)
        newest = None
        for key, _ in self.storage.list(base + "launch-"):
            attempt = protocol.parse_launch_name(key[len(base):])
            if attempt is not None and attempt > after_attempt and (newest is None or attempt > newest):
                newest = attempt
        if newest is None:
            return None
        try:
            doc = json.loads(self.storage.get_bytes(self.launch_key(node_id, newest)))
        except StorageNotFound:
            return None
        environ = os.environ if environ is None else environ
        env = dict(doc.get("env", {}))
        for name in doc.get("secret_env", []):
            if name in environ:
                env[name] = environ[name]
        return int(doc["attempt"]), str(doc["script"]), env

    def ack(self, node_id: str, attempt: int, pid: int) -> None:
        """Say the node took ``attempt``: its script runs as process ``pid`` (rule 4)."""
        self.storage.put_bytes(self.ack_key(node_id, attempt), f"{int(pid)}\n".encode())

    def stop_requested(self, node_id: str, attempt: int) -> bool:
        """Whether the controller asked to stop ``attempt`` (rule 5)."""
        return self.storage.exists(self.stop_key(node_id, attempt))

    def write_failure(self, node_id: str, attempt: int, node_dir: protocol.NodeDir) -> None:
        """Copy ``attempt``'s failure record from the local ``node_dir`` to storage, when there
        is one; call just before :meth:`write_exit` (rule 2a)."""
        try:
            data = Path(node_dir.failure(attempt)).read_bytes()
        except (FileNotFoundError, NotADirectoryError):
            return
        self.storage.put_bytes(self.failure_key(node_id, attempt), data)

    def write_exit(self, node_id: str, attempt: int, code: int) -> None:
        """Publish ``attempt``'s exit code. Call only after the attempt's streams are flushed
        (rule 2; :class:`sftctl.storage.stream.Shipper` does)."""
        self.storage.put_bytes(self.exit_key(node_id, attempt), protocol.format_exit_code(code).encode())


class Shipper:
    """Ship a node directory's files to ``nodes/<node id>/`` in job storage.

    Call :meth:`ship_once` in a loop, or :meth:`start` a thread that does it every
    ``interval_s`` and :meth:`stop` it (which ships what is left). Storage errors during a tick
    are remembered in ``last_error`` and retried on the next tick; nothing is lost or doubled
    (unshipped bytes stay in the file, buffered ones in the writer).

    Args:
        storage: the job's storage.
        node_id: this node's id (the controller's).
        node_dir: the node directory (``$SFTCTL_NODE_DIR``).
        interval_s: seconds between ticks of :meth:`start`'s thread.
        flush_bytes, flush_interval_s: passed to each :class:`StreamWriter`.
    """

    def __init__(self, storage: Storage, node_id: str, node_dir: str | os.PathLike, *, interval_s: float = 1.0,
                 flush_bytes: int = FLUSH_BYTES, flush_interval_s: float = FLUSH_INTERVAL_S):
        self.storage = storage
        self.node_id = node_id
        self.prefix = node_prefix(node_id)
        self.node_dir = Path(node_dir)
        self.channel = NodeChannel(storage)
        self.interval_s = interval_s
        self.flush_bytes, self.flush_interval_s = flush_bytes, flush_interval_s
        self.writers: dict[str, StreamWriter] = {}  # relative path -> writer
        self.offsets: dict[str, int] = {}  # relative path -> bytes of the file read so far
        self.exits_shipped: set[int] = set()
        self.last_error: StorageError | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._tick_lock = threading.Lock()

    def _files(self) -> list[str]:
        names = [n for n in TAILED_FILES if (self.node_dir / n).is_file()]
        metrics = self.node_dir / protocol.METRICS_DIR
        if metrics.is_dir():
            names += sorted(f"{protocol.METRICS_DIR}/{p.name}" for p in metrics.glob("*.jsonl") if p.is_file())
        return names

    def _exit_files(self) -> list[tuple[int, int]]:
        """``[(attempt, exit code)]`` of exit files not shipped yet whose content is complete."""
        return protocol.NodeDir(self.node_dir).exits(skip=self.exits_shipped)

    def _writer(self, rel: str) -> StreamWriter:
        w = self.writers.get(rel)
        if w is None:
            w = StreamWriter(self.storage, self.prefix + rel, flush_bytes=self.flush_bytes,
                             flush_interval_s=self.flush_interval_s)
            self.writers[rel] = w
            self.offsets[rel] = w.total_bytes  # continue after what an earlier shipper sent
        return w

    def _tail(self, rel: str) -> int:
        w = self._writer(rel)
        try:
            with open(self.node_dir / rel, "rb") as fh:
                fh.seek(self.offsets[rel])
                data = fh.read(TAIL_MAX_BYTES)
        except FileNotFoundError:
            return 0
        if data:
            self.offsets[rel] += len(data)
            w.write(data)  # may flush; on error the bytes are buffered and retried
        return len(data)

    def ship_once(self, final: bool = False) -> int:
        """One tick: ship new bytes of every file, flush due segments (all when ``final``), then
        the exit codes that appeared before this tick's reads. Returns the bytes read.

        Raises:
            StorageError: storage failed (also kept in ``last_error``); the next call retries.
        """
        with self._tick_lock:
            try:
                exits = self._exit_files()  # seen before the reads: their logs are complete below
                n = 0
                for rel in self._files():
                    while True:  # drain: an exit code must follow every byte before it
                        got = self._tail(rel)
                        n += got
                        if got < TAIL_MAX_BYTES or not (exits or final):
                            break
                for w in self.writers.values():
                    if exits or final:
                        w.flush()
                    else:
                        w.poll()
                for attempt, code in exits:
                    self.channel.write_failure(self.node_id, attempt, protocol.NodeDir(self.node_dir))
                    self.channel.write_exit(self.node_id, attempt, code)
                    self.exits_shipped.add(attempt)
                self.last_error = None
                return n
            except StorageError as e:
                self.last_error = e
                raise

    def run(self) -> None:
        """Tick every ``interval_s`` until :meth:`stop`; then a final tick (retried a few times)."""
        while not self._stop.wait(self.interval_s):
            try:
                self.ship_once()
            except StorageError as e:
                print(f"sftctl shipper: {e.message} (retrying)", file=sys.stderr, flush=True)
        for i in range(5):
            try:
                self.ship_once(final=True)
                return
            except StorageError as e:
                print(f"sftctl shipper: {e.message} (final flush, try {i + 1})", file=sys.stderr, flush=True)
                time.sleep(min(2.0 ** i, 10.0))

    def start(self) -> "Shipper":
        """Run :meth:`run` in a daemon thread; returns self."""
        self._thread = threading.Thread(target=self.run, name=f"sftctl-shipper-{self.node_id}", daemon=True)
        self._thread.start()
        return self

    def stop(self, timeout_s: float = 60.0) -> None:
        """Stop the thread after a final tick (or ship what is left now if no thread runs)."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout_s)
        else:
            self.ship_once(final=True)


def main(argv: list[str] | None = None) -> int:
    """``python -m sftctl.storage.stream``: ship a node directory until SIGTERM/SIGINT."""
    import argparse
    import signal

    ap = argparse.ArgumentParser(prog="python -m sftctl.storage.stream",
                                 description="Ship a node directory's logs, metrics and exit codes to job storage.")

    ap.add_argument("--storage", default=settings.raw("SFTCTL_STORAGE_URL"), help="job storage URL")
    ap.add_argument("--node-id", default=settings.raw("SFTCTL_NODE_ID"))
    ap.add_argument("--node-dir", default=settings.get("SFTCTL_NODE_DIR"))
    ap.add_argument("--interval", type=float, default=1.0, help="seconds between ticks")
    args = ap.parse_args(argv)
    if not args.storage or not args.node_id:
        ap.error("--storage (or SFTCTL_STORAGE_URL) and --node-id (or SFTCTL_NODE_ID) are required")
    shipper = Shipper(open_storage(args.storage), args.node_id, args.node_dir, interval_s=args.interval)
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: shipper._stop.set())
    shipper.run()
    return 0 if shipper.last_error is None else 4


if __name__ == "__main__":
    sys.exit(main())
