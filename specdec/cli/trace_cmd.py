"""`specd trace list|show`: traced requests from the local trace file
(SPECD_TRACE_FILE; `specd up` sets it), and one request as a waterfall.

    specd trace list              # recent requests, newest first
    specd trace show              # the latest request, one line per span
    specd trace show 4bf92f35     # a trace by id or unique id prefix
"""
from __future__ import annotations

import argparse
import sys
from datetime import datetime

from specdec.telemetry import (A_ACCEPTANCE_RATE, A_ACCEPTED, A_K, A_ROUNDS, GEN_AI_OUTPUT_TOKENS,
                               SPAN_GENERATE)
from specdec.trace_file import default_trace_file, group_traces, read_spans

PHASE_WIDTH = 30


def register(sub) -> None:
    p = sub.add_parser("trace", help="list traced requests or show one as a waterfall (local trace file)")
    actions = p.add_subparsers(dest="action", required=True)
    file_help = "trace file (default: $SPECD_TRACE_FILE, else ~/.cache/specdec/traces.jsonl)"
    lst = actions.add_parser("list", help="recent requests: trace id, start, duration, tokens, acceptance")
    lst.add_argument("--file", default=None, help=file_help)
    lst.add_argument("-n", "--limit", type=int, default=20, help="requests to list (default 20)")
    lst.set_defaults(func=_list)
    show = actions.add_parser("show", help="one trace as a waterfall, one line per span (default: the latest)")
    show.add_argument("trace_id", nargs="?", default=None, help="trace id or a unique prefix of one")
    show.add_argument("--file", default=None, help=file_help)
    show.add_argument("--width", type=int, default=40, help="width of the bars, characters (default 40)")
    show.set_defaults(func=_show)


# ------------------------------------------------------------------ summaries

def root_span(spans: list[dict]) -> dict:
    """The trace's `generate` span, else its earliest span without a parent
    in the trace."""
    ids = {s["span_id"] for s in spans}
    for span in spans:
        if span["name"] == SPAN_GENERATE and span.get("parent_id") not in ids:
            return span
    return next((s for s in spans if s.get("parent_id") not in ids), spans[0])


def summarize(trace_id: str, spans: list[dict]) -> dict:
    root = root_span(spans)
    start = min(s["start_ns"] for s in spans)
    end = max(s.get("end_ns") or s["start_ns"] for s in spans)
    attrs = root.get("attributes", {})
    return {
        "trace_id": trace_id,
        "name": root["name"],
        "start_ns": root["start_ns"],
        "duration_ms": (end - start) / 1e6,
        "tokens": attrs.get(GEN_AI_OUTPUT_TOKENS),
        "rounds": attrs.get(A_ROUNDS),
        "acceptance": attrs.get(A_ACCEPTANCE_RATE),
        "spans": len(spans),
    }


def _clock(ns: int) -> str:
    return datetime.fromtimestamp(ns / 1e9).strftime("%Y-%m-%d %H:%M:%S")


def _opt(value, fmt: str = "{}") -> str:
    return "-" if value is None else fmt.format(value)


def format_list(summaries: list[dict]) -> list[str]:
    lines = [f"{'trace id':<32}  {'start':<19}  {'ms':>9}  {'tokens':>6}  {'rounds':>6}  {'accept':>6}  spans"]
    for s in summaries:
        name = "" if s["name"] == SPAN_GENERATE else f"  ({s['name']})"
        lines.append(f"{s['trace_id']:<32}  {_clock(s['start_ns'])}  {s['duration_ms']:>9.1f}  "
                     f"{_opt(s['tokens']):>6}  {_opt(s['rounds']):>6}  {_opt(s['acceptance'], '{:.2f}'):>6}  "
                     f"{s['spans']}{name}")
    return lines


# ------------------------------------------------------------------ waterfall

def span_tree(spans: list[dict]) -> list[tuple[int, dict]]:
    """(depth, span) in depth-first order, siblings by start time; spans whose
    parent is not in the trace start new roots."""
    ids = {s["span_id"] for s in spans}
    children: dict[str | None, list[dict]] = {}
    for span in spans:
        parent = span.get("parent_id") if span.get("parent_id") in ids else None
        children.setdefault(parent, []).append(span)
    ordered: list[tuple[int, dict]] = []
    stack = [(0, s) for s in sorted(children.get(None, []), key=lambda s: s["start_ns"], reverse=True)]
    while stack:
        depth, span = stack.pop()
        ordered.append((depth, span))
        kids = sorted(children.get(span["span_id"], []), key=lambda s: s["start_ns"], reverse=True)
        stack.extend((depth + 1, kid) for kid in kids)
    return ordered


def _bar(start: int, end: int, t0: int, total: int, width: int) -> str:
    a = int((start - t0) / total * width)
    b = max(a + 1, round((end - t0) / total * width))
    return " " * a + "=" * (min(b, width) - a)


def waterfall(spans: list[dict], width: int = 40) -> list[str]:
    """One line per span: phase (indented by depth), service, start offset
    and duration in ms, k, accepted, and a bar on the trace's time scale."""
    t0 = min(s["start_ns"] for s in spans)
    t1 = max(s.get("end_ns") or s["start_ns"] for s in spans)
    total = max(1, t1 - t0)
    lines = [f"{'phase':<{PHASE_WIDTH}} {'service':<12} {'start ms':>9} {'dur ms':>9} {'k':>3} {'acc':>3}  "
             f"|{'0':<{width // 2}}{total / 1e6:>{width - width // 2}.1f} ms|"]
    for depth, span in span_tree(spans):
        end = span.get("end_ns") or span["start_ns"]
        attrs = span.get("attributes", {})
        phase = "  " * depth + span["name"] + (" !" if span.get("status") == "ERROR" else "")
        service = str(span.get("service", "")).removeprefix("specdec-")
        lines.append(f"{phase[:PHASE_WIDTH]:<{PHASE_WIDTH}} {service[:12]:<12} {(span['start_ns'] - t0) / 1e6:>9.2f} "
                     f"{(end - span['start_ns']) / 1e6:>9.2f} {_opt(attrs.get(A_K)):>3} "
                     f"{_opt(attrs.get(A_ACCEPTED)):>3}  |{_bar(span['start_ns'], end, t0, total, width):<{width}}|")
    return lines


# ------------------------------------------------------------------- commands

def _load(path_arg: str | None) -> dict[str, list[dict]] | None:
    path = path_arg or str(default_trace_file())
    try:
        spans = read_spans(path)
    except FileNotFoundError:
        print(f"specd trace: no trace file at {path} (run `specd up`, or set SPECD_TRACE_FILE for the servers)",
              file=sys.stderr)
        return None
    except IsADirectoryError:
        print(f"specd trace: {path} is a directory: give the trace file (a .jsonl file) itself", file=sys.stderr)
        return None
    except OSError as exc:  # unreadable: permissions, a device
        print(f"specd trace: cannot read {path}: {exc.strerror or exc}", file=sys.stderr)
        return None
    except UnicodeDecodeError:
        print(f"specd trace: {path} is not a trace file (not UTF-8 text)", file=sys.stderr)
        return None
    if not spans:
        print(f"specd trace: {path} holds no spans yet", file=sys.stderr)
        return None
    return group_traces(spans)


def _latest_first(traces: dict[str, list[dict]]) -> list[dict]:
    return sorted((summarize(tid, spans) for tid, spans in traces.items()), key=lambda s: s["start_ns"],
                  reverse=True)


def _list(args: argparse.Namespace) -> int:
    traces = _load(args.file)
    if traces is None:
        return 1
    print("\n".join(format_list(_latest_first(traces)[: max(1, args.limit)])))
    return 0


def _show(args: argparse.Namespace) -> int:
    traces = _load(args.file)
    if traces is None:
        return 1
    if args.trace_id is None:
        trace_id = _latest_first(traces)[0]["trace_id"]
    else:
        matches = [tid for tid in traces if tid.startswith(args.trace_id.lower())]
        if len(matches) != 1:
            what = "no trace" if not matches else f"{len(matches)} traces"
            print(f"specd trace: {what} with id {args.trace_id!r}", file=sys.stderr)
            return 1
        trace_id = matches[0]
    spans = traces[trace_id]
    s = summarize(trace_id, spans)
    print(f"trace {trace_id}  {_clock(s['start_ns'])}  {s['duration_ms']:.1f} ms  {s['spans']} spans  "
          f"tokens {_opt(s['tokens'])}  rounds {_opt(s['rounds'])}  acceptance {_opt(s['acceptance'], '{:.2f}')}")
    print("\n".join(waterfall(spans, max(10, args.width))))
    return 0
