"""`specd trace list|show`: traced requests from the local trace file
(SPECD_TRACE_FILE; `specd up` sets it), and one request as a waterfall.

    specd trace list              # recent requests, newest first
    specd trace show              # the latest request, one line per span
    specd trace show 4bf92f35     # a trace by id or unique id prefix: each of its requests
    specd trace show 00f067aa     # one request by the span id `list` shows (or a unique prefix)

A request is one `generate` span and the spans under it, not a trace: a
caller that sends one traceparent with several Generate calls puts them all
in its trace, and each is still a request of its own.

The files the trace file was rotated to (`<file>.N` ... `<file>.1`, see
SPECD_TRACE_FILE_MAX_BYTES) are read with it, oldest first, so a request
whose spans straddle a rotation shows whole.
"""
from __future__ import annotations

import argparse
import sys
from datetime import datetime
from typing import Iterator, NamedTuple

from specdec.telemetry import (A_ACCEPTANCE_RATE, A_ACCEPTED, A_K, A_ROUNDS, GEN_AI_OUTPUT_TOKENS,
                               SPAN_GENERATE)
from specdec.trace_file import default_trace_file, group_traces, read_spans

PHASE_WIDTH = 30


def register(sub) -> None:
    p = sub.add_parser("trace", help="list traced requests or show one as a waterfall (local trace file)")
    actions = p.add_subparsers(dest="action", required=True)
    file_help = ("trace file (default: $SPECD_TRACE_FILE, else ~/.cache/specdec/traces.jsonl); the files it "
                 "was rotated to, FILE.1 ..., are read too")
    lst = actions.add_parser("list", help="recent requests, one row each: trace id, start, duration, tokens, "
                                                 "rounds, acceptance, spans, span id")
    lst.add_argument("--file", default=None, help=file_help)
    lst.add_argument("-n", "--limit", type=int, default=20, help="requests to list (default 20)")
    lst.set_defaults(func=_list)
    show = actions.add_parser("show", help="one request as a waterfall, one line per span (default: the latest)")
    show.add_argument("trace_id", nargs="?", default=None, metavar="id",
                      help="a request's span id (as `list` shows it), or a trace id to show each of its "
                           "requests in turn; a unique prefix of either will do")
    show.add_argument("--file", default=None, help=file_help)
    show.add_argument("--width", type=int, default=40, help="width of the bars, characters (default 40)")
    show.set_defaults(func=_show)


# ------------------------------------------------------------------ requests

class Request(NamedTuple):
    """One row of `specd trace list`: a root span and the spans under it."""

    trace_id: str
    span_id: str  # the root's: a `generate` span, or the span (not in the file) its orphans hang from
    head: dict  # the span whose name and attributes the row shows
    spans: list[dict]  # the root's subtree, in start order


def _children(spans: list[dict], reroot: bool = False) -> dict[str | None, list[dict]]:
    """Spans by parent span id, each list in file order; with `reroot`, a
    span whose parent is not among `spans` is filed under None, as a root."""
    ids = {s["span_id"] for s in spans} if reroot else None
    children: dict[str | None, list[dict]] = {}
    for span in spans:
        parent = span.get("parent_id")
        if ids is not None and parent not in ids:
            parent = None
        children.setdefault(parent, []).append(span)
    return children


def walk(roots: list[dict], children: dict[str | None, list[dict]], key=None) -> Iterator[tuple[int, dict]]:
    """(depth, span) depth first from `roots` through `children`, each span
    before its children; siblings in `key` order, or, with no key, in no
    order worth relying on. A span id is taken once, so a file with a cycle
    of parent ids (or a span listed twice) cannot loop."""
    seen: set[str] = set()
    stack: list[tuple[int, dict]] = []

    def push(depth: int, spans) -> None:
        for span in sorted(spans, key=key, reverse=True) if key else spans:  # popped last first
            if span["span_id"] not in seen:
                seen.add(span["span_id"])
                stack.append((depth, span))

    push(0, roots)
    while stack:
        depth, span = stack.pop()
        yield depth, span
        push(depth + 1, children.get(span["span_id"], ()))


def subtree(root: dict, children: dict[str | None, list[dict]]) -> list[dict]:
    """`root` and its descendants by parent span id, in start order: the
    draft's and target's spans are among them, children of the
    orchestrator's client spans through the propagated context. A span is
    taken once, so a file with a cycle of parent ids cannot loop."""
    return sorted((span for _, span in walk([root], children)), key=lambda s: s.get("start_ns") or 0)


def requests(trace_id: str, spans: list[dict]) -> list[Request]:
    """A trace's requests: one per `generate` span, its subtree; then the
    spans under no `generate`, one request per span they hang from that is
    not in the file. That is a request still running (its `generate` ends,
    and is written, last: its rounds belong together, not one row each) or
    a trace with no orchestrator in it; a root with no parent at all is
    its own."""
    children = _children(spans)
    found, taken = [], set()
    for span in spans:
        if span["name"] == SPAN_GENERATE and span["span_id"] not in taken:
            members = subtree(span, children)
            taken.update(s["span_id"] for s in members)
            found.append(Request(trace_id, span["span_id"], span, members))
    rest = [s for s in spans if s["span_id"] not in taken]
    ids, rest_children = {s["span_id"] for s in rest}, _children(rest)
    hanging: dict[str, list[dict]] = {}
    for span in rest:
        if span.get("parent_id") not in ids:
            hanging.setdefault(span.get("parent_id") or span["span_id"], []).extend(subtree(span, rest_children))
    for root_id, members in hanging.items():
        members.sort(key=lambda s: s.get("start_ns") or 0)
        found.append(Request(trace_id, root_id, members[0], members))
    return found


def all_requests(traces: dict[str, list[dict]]) -> list[Request]:
    """Every trace's requests, newest first."""
    found = [r for trace_id, spans in traces.items() for r in requests(trace_id, spans)]
    return sorted(found, key=lambda r: r.head["start_ns"], reverse=True)


def summarize(request: Request) -> dict:
    spans, head = request.spans, request.head
    start = min(s["start_ns"] for s in spans)
    end = max(s.get("end_ns") or s["start_ns"] for s in spans)
    attrs = head.get("attributes", {})
    return {
        "trace_id": request.trace_id,
        "span_id": request.span_id,
        "name": head["name"],
        "start_ns": head["start_ns"],
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
    """One line per request; the span id, last, is what `show` takes to pick
    one request of a trace that holds several."""
    lines = [f"{'trace id':<32}  {'start':<19}  {'ms':>9}  {'tokens':>6}  {'rounds':>6}  {'accept':>6}  "
             f"{'spans':>5}  span id"]
    for s in summaries:
        name = "" if s["name"] == SPAN_GENERATE else f"  ({s['name']})"
        lines.append(f"{s['trace_id']:<32}  {_clock(s['start_ns'])}  {s['duration_ms']:>9.1f}  "
                     f"{_opt(s['tokens']):>6}  {_opt(s['rounds']):>6}  {_opt(s['acceptance'], '{:.2f}'):>6}  "
                     f"{s['spans']:>5}  {s['span_id']}{name}")
    return lines


# ------------------------------------------------------------------ waterfall

def span_tree(spans: list[dict]) -> list[tuple[int, dict]]:
    """(depth, span) in depth-first order, siblings by start time; spans whose
    parent is not in the trace start new roots."""
    children = _children(spans, reroot=True)
    return list(walk(children.get(None, []), children, key=lambda s: s["start_ns"]))


def _bar(start: int, end: int, t0: int, total: int, width: int) -> str:
    a = int((start - t0) / total * width)
    b = max(a + 1, round((end - t0) / total * width))
    return " " * a + "=" * (min(b, width) - a)


def waterfall(spans: list[dict], width: int = 40) -> list[str]:
    """One line per span: phase (indented by depth), service, start offset
    and duration in ms, k, accepted, and a bar on the request's time scale."""
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


def _list(args: argparse.Namespace) -> int:
    traces = _load(args.file)
    if traces is None:
        return 1
    print("\n".join(format_list([summarize(r) for r in all_requests(traces)[: max(1, args.limit)]])))
    return 0


def pick(found: list[Request], ident: str | None) -> list[Request] | str:
    """The requests `show` prints, oldest first, or why there are none: the
    latest with no id; a trace's every request for a trace id (or prefix),
    since a trace may hold several; one request for its span id (or
    prefix). A prefix of both kinds, or of several, is ambiguous."""
    if ident is None:
        return found[:1]
    prefix = ident.lower()
    traces = {r.trace_id for r in found if r.trace_id.startswith(prefix)}
    by_span = [r for r in found if r.span_id.startswith(prefix)]
    if len(traces) == 1 and not by_span:
        return sorted((r for r in found if r.trace_id in traces), key=lambda r: r.head["start_ns"])
    if len(by_span) == 1 and not traces:
        return by_span
    if not traces and not by_span:
        return f"no trace or request with id {ident!r}"
    return (f"id {ident!r} is ambiguous: it begins {_count(len(traces), 'trace id')} and "
            f"{_count(len(by_span), 'span id')}: give more of it")


def _count(n: int, noun: str) -> str:
    return f"{n} {noun}{'' if n == 1 else 's'}"


def show_lines(request: Request, width: int) -> list[str]:
    """A request's header line, then its waterfall."""
    s = summarize(request)
    return [f"trace {s['trace_id']}  span {s['span_id']}  {_clock(s['start_ns'])}  {s['duration_ms']:.1f} ms  "
            f"{s['spans']} spans  tokens {_opt(s['tokens'])}  rounds {_opt(s['rounds'])}  "
            f"acceptance {_opt(s['acceptance'], '{:.2f}')}", *waterfall(request.spans, width)]


def _show(args: argparse.Namespace) -> int:
    traces = _load(args.file)
    if traces is None:
        return 1
    chosen = pick(all_requests(traces), args.trace_id)
    if isinstance(chosen, str):
        print(f"specd trace: {chosen}", file=sys.stderr)
        return 1
    for i, request in enumerate(chosen):
        if i:
            print()
        print("\n".join(show_lines(request, max(10, args.width))))
    return 0

