"""What the HTTP front door adds over gRPC, on the same server.

    python -m specdec.bench.front_doors [--requests 100] [--max-tokens 32] [--k 4]

Starts the tiny random pair (`specdec.bench.tiny_pair`) as three child
processes, as `specd up` runs them, the orchestrator with `--http-port 0` and
a word-level tokenizer of the pair's 512 ids (`w0` .. `w511`, built here), so
every token is one word of text. Then, for each of
--requests prompts, the same greedy request through each door, the order
alternating from prompt to prompt so drift on a shared machine falls on both:

- plain: gRPC Generate read to the end vs POST /v1/completions without
  `stream` (per-request latency, client-side wall time), at --max-tokens and
  at 1 token (one round: the fixed cost of a request);
- streamed: gRPC Generate vs POST /v1/completions with `stream` (SSE): time
  to the first text, and time per token after it = (last text - first text)
  / (tokens after the first chunk).

The clients are the ones a user would run: the sync gRPC client
(`orchestrator.client.Client`) and a keep-alive `http.client` connection that
parses the JSON (the `openai` package would add its own parsing on top).
Prints each door's median and the added latency (HTTP - gRPC) as the median
of the per-prompt differences, with their interquartile range (a shared
machine's noise shows there); checks that both doors returned the same text.
"""
from __future__ import annotations

import argparse
import http.client
import json
import re
import statistics
import tempfile
import time
from pathlib import Path

from specdec.bench.services import ServiceOptions, ServiceSet
from specdec.bench.tiny_pair import VOCAB_SIZE, ensure_tiny_pair, tiny_prompts

_HTTP_LINE = re.compile(r"OpenAI-compatible HTTP API on http://[^\s]*:(\d+)/v1")


def word_tokenizer(directory: Path) -> Path:
    """A word-level tokenizer with one word per id of the pair: w0 .. w511."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.WordLevel({f"w{i}": i for i in range(VOCAB_SIZE)}, unk_token="w0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.decoder = decoders.WordPiece(prefix="##", cleanup=False)  # joins words with spaces
    PreTrainedTokenizerFast(tokenizer_object=tok).save_pretrained(directory)
    return directory


def http_port(log_path: Path, timeout_s: float = 60.0) -> int:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        match = _HTTP_LINE.search(log_path.read_text(errors="replace"))
        if match:
            return int(match.group(1))
        time.sleep(0.1)
    raise RuntimeError(f"no HTTP port in {log_path}")


# ------------------------------------------------------------------ clients

def grpc_plain(client, prompt, max_tokens):
    start = time.perf_counter()
    result = client.complete(prompt, max_tokens=max_tokens, temperature=0)
    return time.perf_counter() - start, result.text


def grpc_streamed(client, prompt, max_tokens):
    start, arrivals, text = time.perf_counter(), [], []
    for chunk in client.generate(prompt, max_tokens=max_tokens, temperature=0):
        if chunk.text:
            arrivals.append((time.perf_counter() - start, len(chunk.token_ids)))
            text.append(chunk.text)
    return arrivals, "".join(text)


def http_plain(conn, prompt, max_tokens):
    start = time.perf_counter()
    body = _post(conn, {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0})
    reply = json.loads(body.read())
    return time.perf_counter() - start, reply["choices"][0]["text"]


def http_streamed(conn, prompt, max_tokens):
    """(arrival time, tokens) of the text chunks, and the text. SSE chunks
    carry text only: with the word tokenizer every token is one word."""
    start, arrivals, text = time.perf_counter(), [], []
    response = _post(conn, {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "stream": True})
    for line in response:
        if not line.startswith(b"data: ") or line.startswith(b"data: [DONE]"):
            continue
        choices = json.loads(line[6:])["choices"]
        if choices and choices[0]["text"]:
            arrivals.append((time.perf_counter() - start, len(choices[0]["text"].split())))
            text.append(choices[0]["text"])
    return arrivals, "".join(text)


def _post(conn, body):
    conn.request("POST", "/v1/completions", json.dumps(body), {"Content-Type": "application/json"})
    response = conn.getresponse()
    if response.status != 200:
        raise RuntimeError(f"HTTP {response.status}: {response.read()[:300]!r}")
    return response


def per_token_s(arrivals) -> float | None:
    """(last text - first text) / tokens after the first chunk."""
    after = sum(n for _, n in arrivals[1:])
    return (arrivals[-1][0] - arrivals[0][0]) / after if after else None


# ---------------------------------------------------------------------- run

KEYS = ("plain", "one", "first", "token")


def measure(grpc_address: str, port: int, prompts, max_tokens: int) -> dict:
    """Per prompt, both doors (order alternating): samples[door][key] lists,
    paired by prompt."""
    from orchestrator.client import Client

    samples = {door: {key: [] for key in KEYS} for door in ("grpc", "http")}
    mismatches = 0
    with Client(grpc_address, timeout_s=120) as client:
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=120)
        plain_call = {"grpc": lambda p, n: grpc_plain(client, p, n), "http": lambda p, n: http_plain(conn, p, n)}
        stream_call = {"grpc": lambda p, n: grpc_streamed(client, p, n), "http": lambda p, n: http_streamed(conn, p, n)}
        for i, prompt in enumerate(prompts):
            doors = ("grpc", "http") if i % 2 == 0 else ("http", "grpc")  # alternate the order
            plain = {door: plain_call[door](prompt, max_tokens) for door in doors}
            one = {door: plain_call[door](prompt, 1) for door in doors}
            streamed = {door: stream_call[door](prompt, max_tokens) for door in doors}
            # The doors may chunk differently (gRPC merges the rounds that gather
            # while a write is under way: orchestrator/reply_relay.py): the texts must match.
            arrivals = {door: streamed[door][0] for door in ("grpc", "http")}
            texts = {plain["grpc"][1], plain["http"][1], streamed["grpc"][1], streamed["http"][1]}
            mismatches += len(texts) != 1 or one["grpc"][1] != one["http"][1]
            for door in doors:
                token = per_token_s(arrivals[door])
                for key, value in (("plain", plain[door][0]), ("one", one[door][0]),
                                   ("first", arrivals[door][0][0]), ("token", token)):
                    samples[door][key].append(value)
        conn.close()
    samples["mismatches"] = mismatches
    return samples


def report(samples: dict, args) -> str:
    rows = [("request, 1 token", "one"), (f"request, {args.max_tokens} tokens", "plain"),
            ("first token, streamed", "first"), ("per token, streamed", "token")]
    lines = [f"front doors: {args.requests} greedy requests, tiny pair, k={args.num_draft_tokens}, one server, each request "
             "through both doors (order alternating); client-side ms",
             f"{'':24}{'gRPC median':>12}{'HTTP median':>12}{'added (paired median)':>23}{'paired IQR':>20}"]
    for label, key in rows:
        pairs = [(g, h) for g, h in zip(samples["grpc"][key], samples["http"][key]) if g is not None and h is not None]
        g = statistics.median(p[0] for p in pairs) * 1000
        h = statistics.median(p[1] for p in pairs) * 1000
        diffs = sorted((p[1] - p[0]) * 1000 for p in pairs)
        q1, q2, q3 = statistics.quantiles(diffs, n=4)
        lines.append(f"{label:24}{g:12.3f}{h:12.3f}{q2:+14.3f} ({q2 / g * 100:+5.1f}%){q1:+10.3f} .. {q3:+.3f}")
    lines.append(f"outputs differing between the doors: {samples['mismatches']} of {args.requests}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m specdec.bench.front_doors", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--requests", type=int, default=100)
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--num-draft-tokens", type=int, default=4)
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--threads", type=int, default=1, help="CPU threads per model service")
    args = p.parse_args(argv)
    draft_dir, target_dir = ensure_tiny_pair()
    with tempfile.TemporaryDirectory(prefix="specd-front-doors-") as tmp:
        tokenizer = word_tokenizer(Path(tmp) / "tokenizer")
        services = ServiceSet(ServiceOptions(draft=str(draft_dir), target=str(target_dir), dtype="float32",
                                             threads=args.threads, tokenizer=str(tokenizer), max_context=1024),
                              Path(tmp) / "logs")
        try:
            services.start_models()
            services.wait_models()
            services.start_orchestrator(extra=["--http-port", "0", "--num-draft-tokens", str(args.num_draft_tokens)])
            port = http_port(services.services["orchestrator"].log_path)
            prompts = tiny_prompts(args.requests + args.warmup)
            measure(services.orchestrator_address, port, prompts[:args.warmup], args.max_tokens)
            samples = measure(services.orchestrator_address, port, prompts[args.warmup:], args.max_tokens)
        finally:
            services.stop()
    print(report(samples, args))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
