"""The local trace file: one JSON object per span, one span per line.

Written by `JsonLinesSpanExporter` (SPECD_TRACE_FILE, behind a
BatchSpanProcessor), read by `specd trace`. Several processes may append to
the same file (`specd up` gives its three roles one file): each export is a
single O_APPEND write, so lines from different processes never interleave.

A line:
    {"trace_id": "<32 hex>", "span_id": "<16 hex>", "parent_id": "<16 hex>" | null,
     "name": "round", "service": "specdec-orchestrator", "kind": "INTERNAL",
     "start_ns": 1700000000000000000, "end_ns": ..., "attributes": {...},
     "status": "UNSET" | "OK" | "ERROR", "links": [{"trace_id": ..., "span_id": ...}]}

Rotation: once a batch would take the file past `max_bytes`
(SPECD_TRACE_FILE_MAX_BYTES, default 100 MiB; 0: no bound) it is renamed
`<name>.1`, the older ones shifted up (`.1` to `.2` ...) to at most `keep`
(SPECD_TRACE_FILE_KEEP, default 1), and the batch starts a new file. A batch
is one write into one file, so no span is split across files; the writers
of all processes take an exclusive flock on the file before they look at
its size, so only one of them rotates it, and the others follow the rename.
A process still holding the old file appends to it under its new name: no
span is lost. A rename that fails leaves the file growing (a warning, once)
and is tried again a minute later. `read_spans` reads the rotated files
too, oldest first.
"""
from __future__ import annotations

import errno
import json
import logging
import os
import re
import time
from pathlib import Path
from typing import Iterable, Sequence

from opentelemetry.sdk.trace import ReadableSpan
from opentelemetry.sdk.trace.export import SpanExporter, SpanExportResult

try:
    import fcntl
except ImportError:  # not on POSIX: no lock, rotation is then best effort among processes
    fcntl = None

log = logging.getLogger(__name__)

TRACE_FILE_ENV = "SPECD_TRACE_FILE"
MAX_BYTES_ENV = "SPECD_TRACE_FILE_MAX_BYTES"
KEEP_ENV = "SPECD_TRACE_FILE_KEEP"
DEFAULT_MAX_BYTES = 100 * 2**20  # rotate past 100 MiB: at most (keep + 1) × this on disk
DEFAULT_KEEP = 1  # rotated files kept: `specd trace` reads them all, whole
ROTATE_RETRY_S = 60.0  # after a failed rotation, append past the bound this long before trying again


def default_trace_file() -> Path:
    """`$SPECD_TRACE_FILE`, else `traces.jsonl` in the per-user cache
    (`~/.cache/specdec/traces.jsonl` on Linux): where `specd up` writes."""
    override = os.environ.get(TRACE_FILE_ENV)
    if override:
        return Path(override).expanduser()
    import platformdirs

    return Path(platformdirs.user_cache_dir("specdec")) / "traces.jsonl"


_encode = json.JSONEncoder(separators=(",", ":"), default=str).encode
# A resource's id: (the resource, its service name encoded). Holding the
# resource keeps its id from being reused by another while it is here.
_services: dict[int, tuple[object, str]] = {}


def span_line(span: ReadableSpan) -> str:
    """The span's JSON line (the module's docstring), formatted directly:
    the exporter runs for every span of every round, on a thread that shares
    the GIL with the event loop (tests/test_trace_file.py checks it byte for
    byte against json.dumps of the same fields)."""
    ctx, parent, resource = span.context, span.parent, span.resource
    known = _services.get(id(resource))
    if known is None:
        known = _services[id(resource)] = (resource, _encode(resource.attributes.get("service.name", "")))
    service = known[1]
    links = ",".join('{"trace_id":"%032x","span_id":"%016x"}' % (link.context.trace_id, link.context.span_id)
                     for link in span.links)
    attributes = span.attributes
    return ('{"trace_id":"%032x","span_id":"%016x","parent_id":%s,"name":%s,"service":%s,"kind":"%s",'
            '"start_ns":%d,"end_ns":%d,"attributes":%s,"status":"%s","links":[%s]}\n') % (
        ctx.trace_id, ctx.span_id, '"%016x"' % parent.span_id if parent is not None else "null",
        _encode(span.name), service, span.kind.name, span.start_time, span.end_time,  # an ended span's: ints
        _encode(dict(attributes)) if attributes else "{}", span.status.status_code.name, links)


_SIZE = re.compile(r"\s*(\d+)\s*(?:([kmg])(?:i?b)?|b)?\s*", re.IGNORECASE)


def parse_size(text: str) -> int:
    """Bytes from "104857600", "100M", "100MiB", "64k" (K, M, G: powers of 1024)."""
    m = _SIZE.fullmatch(text)
    if not m:
        raise ValueError(f"{text!r} is not a size: bytes, or a number with K, M or G (e.g. 100M)")
    return int(m[1]) * 1024 ** " kmg".index((m[2] or " ").lower())


def max_bytes_from_env(env) -> int:
    """SPECD_TRACE_FILE_MAX_BYTES (unset or empty: the default; 0: no bound)."""
    text = env.get(MAX_BYTES_ENV, "").strip()
    try:
        return parse_size(text) if text else DEFAULT_MAX_BYTES
    except ValueError as exc:
        raise ValueError(f"{MAX_BYTES_ENV}: {exc}") from None


def keep_from_env(env) -> int:
    """SPECD_TRACE_FILE_KEEP (unset or empty: the default), at least 1."""
    text = env.get(KEEP_ENV, "").strip()
    if not text:
        return DEFAULT_KEEP
    if not (text.isascii() and text.isdigit()) or int(text) < 1:
        raise ValueError(f"{KEEP_ENV}: {text!r} is not a count of rotated files to keep (1 or more)")
    return int(text)


def rotated_name(path: str | os.PathLike, index: int) -> str:
    """`<path>.<index>`: the file rotated `index` times ago."""
    return f"{os.fspath(path)}.{index}"


class JsonLinesSpanExporter(SpanExporter):
    """Appends each batch of spans to the file in one write; rotates the file
    first when the batch would take it past `max_bytes` (0: never), keeping
    `keep` rotated files (the module's docstring)."""

    def __init__(self, path: str | os.PathLike, max_bytes: int = DEFAULT_MAX_BYTES, keep: int = DEFAULT_KEEP):
        if max_bytes < 0:
            raise ValueError(f"trace file max_bytes must be 0 (no bound) or more, not {max_bytes}")
        if keep < 1:
            raise ValueError(f"trace file keep must be 1 or more, not {keep}")
        self.path = Path(path).expanduser()
        self.max_bytes, self.keep = max_bytes, keep
        self._retry_at = 0.0  # time.monotonic() before which a failed rotation is not tried again
        self._warned = False
        self.path.parent.mkdir(parents=True, exist_ok=True)

    def export(self, spans: Sequence[ReadableSpan]) -> SpanExportResult:
        data = "".join(span_line(s) for s in spans).encode()
        try:
            fd = self._open()
            try:
                if self.max_bytes:
                    fd = self._room_for(fd, len(data))
                view = memoryview(data)
                while view:
                    view = view[os.write(fd, view):]
            finally:
                os.close(fd)  # and with it the lock
        except OSError:
            return SpanExportResult.FAILURE
        return SpanExportResult.SUCCESS

    def _open(self) -> int:
        return os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)

    def _room_for(self, fd: int, size: int) -> int:
        """The descriptor to append `size` bytes to, locked: `fd`'s file while
        they fit under the bound, or it is empty (a batch larger than the
        bound has a file to itself), or rotation failed; else a new file,
        once this exporter or another process has rotated the old one."""
        for _ in range(64):  # each turn after the first follows a rotation (or the file's removal): a
            # writer that keeps losing the race, or cannot open the file again, writes where it is anyway
            _lock(fd)
            held = os.fstat(fd)
            try:
                named = os.stat(self.path)
            except OSError:  # rotated, or deleted, since it was opened
                named = None
            if named is not None and (named.st_dev, named.st_ino) == (held.st_dev, held.st_ino):
                if (held.st_size == 0 or held.st_size + size <= self.max_bytes
                        or time.monotonic() < self._retry_at or not self._rotate()):
                    return fd
            fd = self._reopen(fd)
        _lock(fd)
        return fd

    def _reopen(self, fd: int) -> int:
        """The file now at the path, in place of `fd`; `fd` itself when it
        cannot be opened (the spans then go to the file rotated away)."""
        try:
            new = self._open()
        except OSError:
            return fd
        os.close(fd)
        return new

    def _rotate(self) -> bool:
        """Shift `<name>.1` ... up to the first free slot (at most `keep`,
        whose file is replaced), rename the file `<name>.1`, and drop any
        rotated files past `keep`. Called holding the file's lock. False,
        with a warning the first time, when a rename fails."""
        name = os.fspath(self.path)
        try:
            top = 1
            while top < self.keep and os.path.exists(rotated_name(name, top)):
                top += 1
            for i in range(top - 1, 0, -1):
                os.replace(rotated_name(name, i), rotated_name(name, i + 1))
            os.replace(name, rotated_name(name, 1))
        except FileNotFoundError as exc:
            if exc.filename == name or not os.path.exists(name):
                return True  # the file is gone (deleted): the next open starts a new one
            return self._failed(exc)
        except OSError as exc:
            return self._failed(exc)
        extra = self.keep + 1
        while True:  # left by a larger `keep` before
            try:
                os.unlink(rotated_name(name, extra))
            except OSError:
                break
            extra += 1
        return True

    def _failed(self, exc: OSError) -> bool:
        self._retry_at = time.monotonic() + ROTATE_RETRY_S
        if not self._warned:
            self._warned = True
            log.warning("trace file %s: cannot rotate it (%s): spans are still appended to it, past %d bytes; "
                        "trying again every %.0f s (this is the only warning)",
                        self.path, exc.strerror or exc, self.max_bytes, ROTATE_RETRY_S)
        return False

    def shutdown(self) -> None:
        pass

    def force_flush(self, timeout_millis: int = 30000) -> bool:
        return True


def _lock(fd: int) -> None:
    """An exclusive lock on the file, released when `fd` is closed: one
    writer at a time looks at its size and rotates or appends."""
    if fcntl is not None:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
        except OSError:  # no locks here (some network file systems): write unlocked
            pass


def rotated_files(path: str | os.PathLike) -> list[Path]:
    """The trace file's rotated predecessors present, newest first:
    `<name>.1`, `<name>.2` ..."""
    path = Path(path)
    prefix = path.name + "."
    found = []
    try:
        entries = list(os.scandir(path.parent))
    except OSError:
        return []
    for entry in entries:
        suffix = entry.name[len(prefix):]
        if (entry.name.startswith(prefix) and suffix.isascii() and suffix.isdigit()
                and suffix == str(int(suffix)) and int(suffix) > 0):
            found.append((int(suffix), path.parent / entry.name))
    return [p for _, p in sorted(found)]


def read_spans(path: str | os.PathLike, rotated: bool = True) -> list[dict]:
    """Every span in the file and, with `rotated`, in its rotated
    predecessors (`<name>.N` ... `<name>.1`, then the file: oldest first,
    so a request whose spans straddle a rotation reads whole). A torn last
    line (a process killed mid-write) is skipped. The files are all opened
    before any is read, newest first, and a file met twice (renamed by a
    rotation in between) read once. FileNotFoundError when there is none."""
    opened, seen = [], set()
    try:
        try:
            opened.append(open(path, encoding="utf-8"))
        except FileNotFoundError:
            if not rotated:
                raise
        for older in rotated_files(path) if rotated else ():
            try:
                f = open(older, encoding="utf-8")
            except FileNotFoundError:  # rotated away meanwhile
                continue
            opened.append(f)
        if not opened:
            raise FileNotFoundError(errno.ENOENT, os.strerror(errno.ENOENT), os.fspath(path))
        spans = []
        for f in reversed(opened):
            st = os.fstat(f.fileno())
            if (st.st_dev, st.st_ino) in seen:
                continue
            seen.add((st.st_dev, st.st_ino))
            spans.extend(_spans_in(f))
        return spans
    finally:
        for f in opened:
            f.close()


def _spans_in(f) -> list[dict]:
    spans = []
    for line in f:
        try:
            span = json.loads(line)
        except json.JSONDecodeError:
            continue
        if isinstance(span, dict) and "trace_id" in span and "span_id" in span:
            spans.append(span)
    return spans


def group_traces(spans: Iterable[dict]) -> dict[str, list[dict]]:
    """Spans by trace id, each trace's spans in start order."""
    traces: dict[str, list[dict]] = {}
    for span in spans:
        traces.setdefault(span["trace_id"], []).append(span)
    for members in traces.values():
        members.sort(key=lambda s: s.get("start_ns") or 0)
    return traces
