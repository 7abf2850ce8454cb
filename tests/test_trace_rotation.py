"""specdec/trace_file.py's rotation: past SPECD_TRACE_FILE_MAX_BYTES the
trace file is renamed `<name>.1` (older ones shifted up, `keep` of them
kept) and a new one started, a batch never split across two files and no
span lost, several writers on one file included; 0 is no bound; a rename
that fails leaves the writer appending (one warning). `read_spans` and
`specd trace` read the rotated files too, oldest first."""
from __future__ import annotations

import json
import logging
import os
import threading

import pytest
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from specdec import telemetry as T
from specdec import trace_file
from specdec.cli.main import main as specd
from specdec.trace_file import JsonLinesSpanExporter, read_spans, span_line
from tests.test_trace_file import CALLER, SHARED, _generate

BOUND = 4096


def made_spans(n: int, pad: int = 40):
    """`n` ended spans, each with an attribute of `pad` characters."""
    exporter = InMemorySpanExporter()
    provider = TracerProvider(resource=Resource.create({"service.name": "specdec-test"}))
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    tracer = provider.get_tracer("t")
    for i in range(n):
        tracer.start_span(f"s{i}", attributes={"i": i, "pad": "x" * pad}).end()
    return list(exporter.get_finished_spans())


def files_of(path) -> list:
    """The trace file and its rotated files present, oldest first."""
    rotated = sorted((p for p in path.parent.iterdir() if p.name.startswith(path.name + ".")),
                     key=lambda p: int(p.name.rsplit(".", 1)[1]), reverse=True)
    return rotated + ([path] if path.exists() else [])


def batches(spans, sizes):
    out, i = [], 0
    for size in sizes:
        out.append(spans[i:i + size])
        i += size
    return out


def test_the_file_rotates_at_the_bound_keeping_n_old_ones_and_whole_batches(tmp_path):
    path = tmp_path / "t.jsonl"
    spans = made_spans(300)
    written = batches(spans, [1, 7, 3, 12, 5, 9, 2, 11] * 6)
    exporter = JsonLinesSpanExporter(path, max_bytes=BOUND, keep=3)
    for batch in written:
        assert exporter.export(batch).name == "SUCCESS"
    blobs = ["".join(span_line(s) for s in batch) for batch in written if batch]
    total = sum(map(len, blobs))
    assert total > 6 * BOUND, "enough for more rotations than are kept"

    files = files_of(path)
    assert [p.name for p in files] == ["t.jsonl.3", "t.jsonl.2", "t.jsonl.1", "t.jsonl"]
    texts = [p.read_text() for p in files]
    for p, text in zip(files, texts):
        assert 0 < p.stat().st_size <= BOUND and text.endswith("\n")
        assert all(json.loads(line)["span_id"] for line in text.splitlines()), "no line torn"
    # The files, oldest first, are the latest batches written, each batch whole in one file...
    everything, joined = "".join(blobs), "".join(texts)
    assert everything.endswith(joined)
    offset, starts = len(joined) - len(everything), {}  # where the first batch begins, joined's offsets
    for blob in blobs:
        starts[offset] = blob
        offset += len(blob)
    at = 0
    for i, text in enumerate(texts):
        assert at in starts, "a file begins where a batch does"
        at += len(text)
        # ... and a file was rotated only when the next batch would not fit in it.
        if i < len(texts) - 1:
            assert len(text) + len(starts[at]) > BOUND

    read = read_spans(path)
    assert [s["name"] for s in read] == [json.loads(line)["name"] for line in joined.splitlines()]


def test_a_batch_larger_than_the_bound_has_a_file_to_itself(tmp_path):
    path = tmp_path / "t.jsonl"
    small, large = made_spans(2), made_spans(40, pad=200)
    exporter = JsonLinesSpanExporter(path, max_bytes=BOUND, keep=2)
    exporter.export(small)
    exporter.export(large)
    exporter.export(small)
    big = "".join(span_line(s) for s in large)
    assert len(big) > BOUND
    assert [p.read_text() for p in files_of(path)] == ["".join(span_line(s) for s in small), big,
                                                       "".join(span_line(s) for s in small)]


def test_keep_one_replaces_the_old_file_and_larger_leftovers_go(tmp_path):
    path = tmp_path / "t.jsonl"
    (tmp_path / "t.jsonl.2").write_text("left by a larger keep\n")
    (tmp_path / "t.jsonl.5").write_text("not next to the others: not ours to count\n")
    spans = made_spans(200)
    exporter = JsonLinesSpanExporter(path, max_bytes=BOUND)  # keep: the default, 1
    assert exporter.keep == trace_file.DEFAULT_KEEP == 1
    for batch in batches(spans, [10] * 20):
        exporter.export(batch)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["t.jsonl", "t.jsonl.1", "t.jsonl.5"]
    names = [s["name"] for s in read_spans(path, rotated=False)]
    older = [json.loads(line)["name"] for line in (tmp_path / "t.jsonl.1").read_text().splitlines()]
    assert older + names == [s.name for s in spans][-len(older + names):], "the latest spans, in order"


def test_zero_is_no_bound(tmp_path):
    path = tmp_path / "t.jsonl"
    spans = made_spans(100, pad=100)
    exporter = JsonLinesSpanExporter(path, max_bytes=0, keep=1)
    for batch in batches(spans, [5] * 20):
        exporter.export(batch)
    assert path.stat().st_size > 4 * BOUND
    assert [p.name for p in tmp_path.iterdir()] == ["t.jsonl"]
    assert len(read_spans(path)) == 100


def test_a_failed_rename_warns_once_and_loses_nothing(tmp_path, monkeypatch, caplog):
    path = tmp_path / "t.jsonl"
    spans = made_spans(80)
    real_replace = os.replace
    calls = []

    def refuse(src, dst, *args, **kwargs):
        if not os.fspath(src).startswith(str(tmp_path)):
            return real_replace(src, dst, *args, **kwargs)  # anyone else's: pytest's, xdist's
        calls.append(src)
        raise PermissionError(13, "Permission denied", src)

    monkeypatch.setattr(os, "replace", refuse)
    exporter = JsonLinesSpanExporter(path, max_bytes=BOUND, keep=2)
    with caplog.at_level(logging.WARNING, logger="specdec.trace_file"):
        for batch in batches(spans, [10] * 6):
            assert exporter.export(batch).name == "SUCCESS"
        exporter._retry_at = 0.0  # a minute on: tried again, fails again, and says nothing more
        assert exporter.export(spans[60:70]).name == "SUCCESS"
    assert len(calls) == 2, "tried once, then not again until a minute has passed"
    warnings = [r for r in caplog.records if "cannot rotate" in r.getMessage()]
    assert len(warnings) == 1 and str(path) in warnings[0].getMessage()
    assert path.stat().st_size > BOUND and [p.name for p in tmp_path.iterdir()] == ["t.jsonl"]
    assert [s["name"] for s in read_spans(path)] == [s.name for s in spans[:70]]

    monkeypatch.setattr(os, "replace", real_replace)  # once renames work again, it rotates
    exporter._retry_at = 0.0
    assert exporter.export(spans[70:80]).name == "SUCCESS"
    assert [p.name for p in files_of(path)] == ["t.jsonl.1", "t.jsonl"]
    assert len((tmp_path / "t.jsonl").read_text().splitlines()) == 10
    assert [s["name"] for s in read_spans(path)] == [s.name for s in spans[:80]]


def test_writers_sharing_a_file_rotate_it_once_and_lose_no_span(tmp_path):
    """Three exporters (the roles of `specd up`) on one file, each on its own
    thread: each takes the file's lock before it looks at its size."""
    path = tmp_path / "t.jsonl"
    spans = made_spans(600)
    exporters = [JsonLinesSpanExporter(path, max_bytes=BOUND, keep=100) for _ in range(3)]
    work = [batches(spans[i * 200:(i + 1) * 200], [4] * 50) for i in range(3)]
    threads = [threading.Thread(target=lambda e=e, w=w: [e.export(b) for b in w]) for e, w in zip(exporters, work)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    files = files_of(path)
    assert len(files) > 5
    for p in files:
        assert p.stat().st_size <= BOUND
        assert all(json.loads(line) for line in p.read_text().splitlines())
    read = [s["name"] for s in read_spans(path)]
    assert sorted(read) == sorted(s.name for s in spans) and len(read) == 600


def test_rotation_behind_the_batch_processor_keeps_every_span(tmp_path):
    path = tmp_path / "t.jsonl"
    bound = 5 * BOUND  # a few of the batches flushed below
    settings = T.TelemetrySettings(trace_file=str(path), trace_file_max_bytes=bound, trace_file_keep=50)
    telemetry = T.setup_telemetry("specdec-test", settings)
    for i in range(400):
        with telemetry.span(f"s{i}", {"pad": "y" * 40}):
            pass
        if i % 10 == 9:
            telemetry.force_flush()
    telemetry.shutdown()
    assert len(files_of(path)) > 3 and all(p.stat().st_size <= bound for p in files_of(path))
    assert sorted(s["name"] for s in read_spans(path)) == sorted(f"s{i}" for i in range(400))


def test_the_bound_and_the_count_come_from_the_environment(tmp_path):
    s = T.TelemetrySettings.from_env({})
    assert (s.trace_file_max_bytes, s.trace_file_keep) == (100 * 2**20, 1)
    s = T.TelemetrySettings.from_env({"SPECD_TRACE_FILE_MAX_BYTES": "64K", "SPECD_TRACE_FILE_KEEP": "3"})
    assert (s.trace_file_max_bytes, s.trace_file_keep) == (65536, 3)
    for text, size in [("0", 0), ("1048576", 2**20), ("100M", 100 * 2**20), ("2GiB", 2 * 2**30), ("512b", 512)]:
        assert T.TelemetrySettings.from_env({"SPECD_TRACE_FILE_MAX_BYTES": text}).trace_file_max_bytes == size
    with pytest.raises(ValueError, match="SPECD_TRACE_FILE_MAX_BYTES: '10X' is not a size"):
        T.TelemetrySettings.from_env({"SPECD_TRACE_FILE_MAX_BYTES": "10X"})
    with pytest.raises(ValueError, match="SPECD_TRACE_FILE_KEEP"):
        T.TelemetrySettings.from_env({"SPECD_TRACE_FILE_KEEP": "0"})
    with pytest.raises(ValueError):
        JsonLinesSpanExporter(tmp_path / "t.jsonl", max_bytes=-1)
    exporter = JsonLinesSpanExporter(tmp_path / "t.jsonl")
    assert (exporter.max_bytes, exporter.keep) == (100 * 2**20, 1)


# ------------------------------------------------------------ reading

def _lines(spans) -> str:
    return "".join(json.dumps(s) + "\n" for s in spans)


def test_specd_trace_reads_the_rotated_files_oldest_first(tmp_path, capsys):
    """A request whose spans straddle two rotations shows whole; an older
    request, in an older file, is listed; names that are not rotations of
    the file are not read."""
    old = _generate(SHARED, "a" * 16, CALLER, 0, 10, 4, 0.5)
    new = _generate(SHARED, "b" * 16, CALLER, 5000, 99, 30, 0.9)
    path = tmp_path / "t.jsonl"
    (tmp_path / "t.jsonl.3").write_text(_lines(old))
    (tmp_path / "t.jsonl.2").write_text(_lines(new[1:3]))
    (tmp_path / "t.jsonl.1").write_text(_lines(new[3:4]))
    path.write_text(_lines([new[0], new[4]]))
    (tmp_path / "t.jsonl.old").write_text(_lines(_generate(SHARED, "c" * 16, CALLER, 9000, 1, 1, 1.0)))
    (tmp_path / "t.jsonl.01").write_text(_lines(_generate(SHARED, "d" * 16, CALLER, 9000, 1, 1, 1.0)))

    assert [s["span_id"] for s in read_spans(path)] == [s["span_id"] for s in old + new[1:3] + new[3:4]
                                                         + [new[0], new[4]]]
    assert len(read_spans(path, rotated=False)) == 2

    assert specd(["trace", "show", "bbbb", "--file", str(path)]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert "5 spans" in lines[0] and "tokens 99" in lines[0]
    assert [line.split()[0] for line in lines[2:]] == ["generate", "round", "draft.propose", "propose",
                                                        "session.close"]
    assert specd(["trace", "list", "--file", str(path)]) == 0
    rows = [row.split() for row in capsys.readouterr().out.splitlines()[1:]]
    assert [row[-1] for row in rows] == ["b" * 16, "a" * 16]

    path.unlink()  # the rotated files alone still read
    assert specd(["trace", "show", "aaaa", "--file", str(path)]) == 0
    assert "5 spans" in capsys.readouterr().out
    for p in tmp_path.glob("t.jsonl.[0-9]"):
        p.unlink()
    assert specd(["trace", "list", "--file", str(path)]) == 1
    assert "no trace file at" in capsys.readouterr().err


def test_a_rotation_while_reading_reads_each_file_once(tmp_path, monkeypatch):
    """The files are opened newest first, before any is read: a rotation
    between opening the file and listing the rotated ones shows the file
    twice (as itself and as `.1`), read once."""
    path = tmp_path / "t.jsonl"
    first, second = made_spans(3), made_spans(2)
    (tmp_path / "t.jsonl.1").write_text("".join(span_line(s) for s in first))
    path.write_text("".join(span_line(s) for s in second))
    listing = trace_file.rotated_files

    def rotating_meanwhile(p):
        os.replace(tmp_path / "t.jsonl.1", tmp_path / "t.jsonl.2")
        os.replace(path, tmp_path / "t.jsonl.1")
        path.write_text("")
        return listing(p)

    monkeypatch.setattr(trace_file, "rotated_files", rotating_meanwhile)
    assert [s["name"] for s in read_spans(path)] == [s.name for s in first + second]
