"""Fuzzing the orchestrator's two front doors: gRPC Generate and the
OpenAI-compatible HTTP API.

Generate requests are drawn from the contract (`contract.message`) with the
domain's sane values mixed with wild ones; `expect_generate` decides from the
contract and the server's settings (the fuzz system's: `FRONT_DOOR`) whether
a request must succeed. HTTP bodies are JSON objects of sane fields, wild
JSON values, unknown fields, or not JSON at all; no answer may be a 5xx, and a
sane body must get 200.
"""
from __future__ import annotations

import json
import math
import urllib.error
import urllib.request

import grpc
from hypothesis import strategies as st

from specdec.fuzz import contract
from specdec.fuzz.contract import FLOAT32, INT32, TEXT, UINT64, mostly
from specdec.fuzz.oracle import CALL_TIMEOUT_S, Expect, Outcome, Tally, call
from specdec.fuzz.system import MAX_CONTEXT, ROWS, USABLE_VOCAB
from specdec.sampling.params import MIN_TEMPERATURE
from specdec.v1 import orchestrator_pb2 as pb
from specdec.v1 import orchestrator_pb2_grpc

# The fuzz system's orchestrator settings (system._start_orchestrator).
MAX_TOKENS_LIMIT, DEFAULT_MAX_TOKENS, DEFAULT_K, DEFAULT_K_MIN = 64, 4, 4, 1
POLICIES = ("fixed", "adaptive", "goodput")
WORDS = ["the", "quick", "brown", "fox", "hello", "world", "café", "日本語", "🎉", "def", "f(x)", "\n"]
SANE_TEXT = st.lists(st.sampled_from(WORDS), min_size=1, max_size=8).map(" ".join)
HUGE_TEXT = st.sampled_from([300, 5000]).map(lambda n: "fox " * n)


# ------------------------------------------------------------ gRPC Generate

def _speculation(limit: int, wild: bool):
    sane = st.builds(pb.SpeculationOptions, policy=st.sampled_from(["", *POLICIES]),
                     num_draft_tokens=st.integers(0, limit), min_draft_tokens=st.sampled_from([0, 1]),
                     max_draft_tokens=st.sampled_from([0, limit]), disable=st.booleans(),
                     pipeline=st.sampled_from([None, True, False]))
    if not wild:
        return st.one_of(st.none(), sane)
    return contract.message(pb.SpeculationOptions, {
        "policy": st.one_of(st.sampled_from(["FIXED", "greedy", " fixed"]), TEXT),
        "num_draft_tokens": st.one_of(st.integers(-2, limit + 2), INT32),
        "min_draft_tokens": st.one_of(st.integers(-2, limit + 2), INT32),
        "max_draft_tokens": st.one_of(st.integers(-2, limit + 2), INT32)})


def generate_requests(limit: int):
    """Half sane requests (every field drawn from its sane values), half with
    each field wild one time in three."""
    ids = st.lists(st.integers(0, USABLE_VOCAB - 1), min_size=1, max_size=20)
    wild_ids = st.one_of(st.just([]), st.lists(st.one_of(st.integers(USABLE_VOCAB, ROWS), st.integers(-2, -1), INT32),
                                               min_size=1, max_size=3),
                         st.sampled_from([MAX_CONTEXT, 5000]).map(lambda n: [9] * n))

    def chat(wild: bool):
        role, content = st.sampled_from(["system", "user", "assistant"]), SANE_TEXT
        if wild:
            role, content = mostly(role, TEXT, 3), mostly(content, st.one_of(TEXT, HUGE_TEXT), 3)
        one = st.builds(pb.ChatMessage, role=role, content=content)
        sizes = mostly(st.lists(one, min_size=1, max_size=3), st.lists(one, max_size=6), 3) if wild else \
            st.lists(one, min_size=1, max_size=3)
        return sizes.map(lambda m: pb.ChatMessages(messages=m))

    sane = {
        "prompt": SANE_TEXT,
        "prompt_token_ids": ids.map(lambda t: pb.TokenIds(token_ids=t)),
        "messages": chat(False),
        "max_tokens": st.integers(0, 8),
        "temperature": st.sampled_from([None, 0.0, 0.0, 0.7, 1.0]),
        "top_k": st.sampled_from([0, 5, 50]),
        "top_p": st.sampled_from([None, 0.9, 1.0]),
        "seed": st.one_of(st.none(), UINT64),
        "stop": st.one_of(st.just([]), st.lists(st.sampled_from(["fox", "o", ".", "xyz"]), max_size=3)),
        "speculation": _speculation(limit, wild=False),
        "request_id": TEXT,
    }
    wild = {
        "prompt": st.one_of(TEXT, HUGE_TEXT),
        "prompt_token_ids": wild_ids.map(lambda t: pb.TokenIds(token_ids=t)),
        "messages": chat(True),
        "max_tokens": st.one_of(st.integers(-2, 0), st.sampled_from([64, 65, 250]), INT32),
        "temperature": FLOAT32,
        "top_k": st.one_of(st.integers(-2, -1), INT32),
        "top_p": FLOAT32,
        "stop": st.one_of(st.lists(TEXT, max_size=10), st.just(["a" * 257])),
        "speculation": _speculation(limit, wild=True),
    }
    mixed = {name: mostly(value, wild[name], 3) if name in wild else value for name, value in sane.items()}
    return mostly(contract.message(pb.GenerateRequest, sane, set_oneofs=True),
                  contract.message(pb.GenerateRequest, mixed), 2)


def prompt_tokens(req, tokenizer) -> list[int] | None:
    """The prompt as the orchestrator reads it; None when the input is refused."""
    which = req.WhichOneof("input")
    if which == "prompt_token_ids":
        return list(req.prompt_token_ids.token_ids)
    if which == "prompt":
        return list(tokenizer(req.prompt, add_special_tokens=True)["input_ids"])
    if which == "messages":
        messages = [{"role": m.role, "content": m.content} for m in req.messages.messages]
        if not messages or any(m["role"] not in ("system", "user", "assistant") for m in messages):
            return None
        ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
        return list(ids["input_ids"] if hasattr(ids, "keys") else ids)
    return None


def expect_generate(req, tokenizer, limit: int) -> tuple[Expect, int]:
    """(whether the contract says the request succeeds, its max_tokens)."""
    prompt = prompt_tokens(req, tokenizer)
    max_tokens = req.max_tokens or DEFAULT_MAX_TOKENS
    if not prompt or not all(0 <= t < USABLE_VOCAB for t in prompt):
        return Expect.FAIL, max_tokens
    if not 1 <= max_tokens <= MAX_TOKENS_LIMIT or len(prompt) + max_tokens > MAX_CONTEXT:
        return Expect.FAIL, max_tokens
    t = req.temperature if req.HasField("temperature") else 1.0
    p = req.top_p if req.HasField("top_p") else 1.0
    if not (math.isfinite(t) and (t == 0 or t >= MIN_TEMPERATURE) and req.top_k >= 0 and not math.isnan(p)
            and 0 < p <= 1):
        return Expect.FAIL, max_tokens
    if len(req.request_id) > 256:  # it is recorded on the request's span
        return Expect.FAIL, max_tokens
    if len(req.stop) > 8 or any(not s or len(s) > 256 for s in req.stop):
        return Expect.FAIL, max_tokens
    o = req.speculation
    k, k_min, k_max = o.num_draft_tokens or DEFAULT_K, o.min_draft_tokens or DEFAULT_K_MIN, o.max_draft_tokens or limit
    if (o.policy or "fixed") not in POLICIES or not all(1 <= v <= limit for v in (k, k_min, k_max)) \
            or not k_min <= k <= k_max:
        return Expect.FAIL, max_tokens
    if o.HasField("draft_min_confidence") and not 0.0 <= o.draft_min_confidence <= 1.0:  # a probability (NaN too)
        return Expect.FAIL, max_tokens
    return Expect.OK, max_tokens


class GenerateFuzzer:
    def __init__(self, port: int, tally: Tally, tokenizer, limit: int):
        self.tally = tally
        self.tokenizer = tokenizer
        self.limit = limit
        self.channel = grpc.insecure_channel(f"127.0.0.1:{port}")
        self.stub = orchestrator_pb2_grpc.OrchestratorServiceStub(self.channel)

    def close(self) -> None:
        self.channel.close()

    def send(self, req) -> None:
        expect, max_tokens = expect_generate(req, self.tokenizer, self.limit)
        out = call(self.stub.Generate, req, streaming=True)
        if self.tally.check("orchestrator", "Generate", out, expect, req):
            self._check_stream(req, out, max_tokens)

    def _check_stream(self, req, out: Outcome, max_tokens: int) -> None:
        replies = out.response
        if not replies or not replies[-1].HasField("stats") or any(r.HasField("stats") for r in replies[:-1]):
            self.tally.violate("orchestrator", "Generate", "the stream does not end with one stats message", req)
            return
        tokens = [t for r in replies[:-1] for t in r.chunk.token_ids]
        stats = replies[-1].stats
        if not all(0 <= t < USABLE_VOCAB for t in tokens) or stats.completion_tokens != len(tokens) or \
                len(tokens) > max_tokens or \
                (stats.finish_reason == pb.FINISH_REASON_LENGTH and len(tokens) != max_tokens):
            self.tally.violate("orchestrator", "Generate",
                               f"{len(tokens)} tokens {tokens[:10]}, stats {stats.completion_tokens} "
                               f"{pb.FinishReason.Name(stats.finish_reason)}, max_tokens {max_tokens}", req)

    def raw(self, data: bytes) -> None:
        method = self.channel.unary_stream("/specdec.v1.OrchestratorService/Generate",
                                           request_serializer=lambda b: b, response_deserializer=lambda b: b)
        self.tally.check("orchestrator", "raw:Generate", call(method, data, streaming=True), Expect.ANY, data)


def witness_requests() -> list:
    """A greedy and a seeded sampled request: each must give the same tokens
    whatever it is batched with."""
    greedy = pb.GenerateRequest(prompt_token_ids=pb.TokenIds(token_ids=[11, 12, 13, 14, 15]), max_tokens=24,
                                temperature=0.0, speculation=pb.SpeculationOptions(policy="fixed", num_draft_tokens=4))
    sampled = pb.GenerateRequest(prompt_token_ids=pb.TokenIds(token_ids=[21, 22, 23]), max_tokens=16,
                                 temperature=0.8, top_p=0.95, seed=1234,
                                 speculation=pb.SpeculationOptions(policy="adaptive"))
    return [greedy, sampled]


def generate_tokens(stub, req) -> list[int]:
    return [t for r in stub.Generate(req, timeout=CALL_TIMEOUT_S) for t in r.chunk.token_ids]


# ------------------------------------------------------------ HTTP

JSON = st.recursive(st.one_of(st.none(), st.booleans(), st.integers(-(2**70), 2**70), st.floats(), TEXT),
                    lambda inner: st.one_of(st.lists(inner, max_size=4), st.dictionaries(TEXT, inner, max_size=4)),
                    max_leaves=8)
FIELDS = ["model", "max_tokens", "temperature", "top_p", "top_k", "seed", "stop", "stream", "stream_options",
          "user", "speculation", "n", "presence_penalty", "logit_bias", "echo", "logprobs", "max_completion_tokens",
          "metadata", "tools", "response_format"]


@st.composite
def http_body(draw):
    """(path, body bytes, whether it is sane)."""
    chat = draw(st.booleans())
    path = "/v1/chat/completions" if chat else "/v1/completions"
    body: dict = {}
    if chat:
        body["messages"] = [{"role": draw(st.sampled_from(["system", "user"])), "content": draw(SANE_TEXT)}]
    else:
        body["prompt"] = draw(st.one_of(SANE_TEXT, st.lists(st.integers(0, USABLE_VOCAB - 1), min_size=1, max_size=8)))
    body["max_tokens"] = draw(st.integers(1, 8))
    body["temperature"] = draw(st.sampled_from([0, 0.7]))
    if draw(st.booleans()):
        body["stream"] = True
    kind = draw(st.integers(0, 6))
    if kind == 6:  # JSON text with a lone surrogate escape in a string field
        name = "messages" if chat else draw(st.sampled_from(["prompt", "stop"]))
        text = json.dumps(body).replace("}", ', "stop": ["\\udc80"]}', 1) if name == "stop" else \
            json.dumps(body).replace('"content": "', '"content": "\\ud800', 1).replace('"prompt": "', '"prompt": "\\ud83d', 1)
        return path, text.encode(), False
    if kind <= 1:
        return path, json.dumps(body).encode(), True
    if kind == 2:  # a wild value for one field, known or not
        name = draw(st.one_of(st.sampled_from(FIELDS + ["messages", "prompt"]), TEXT))
        body[name] = draw(JSON)
        return path, json.dumps(body).encode(), False
    if kind == 3:  # wild fields of every kind
        body = draw(st.dictionaries(st.one_of(st.sampled_from(FIELDS), TEXT), JSON, max_size=6))
        return path, json.dumps(body).encode(), False
    if kind == 4:  # not an object, or not JSON
        return path, draw(st.one_of(JSON.map(lambda v: json.dumps(v).encode()), st.binary(max_size=40))), False
    body["max_tokens"] = draw(st.sampled_from([0, -1, 10**6, 2**63, 1.5, "8"]))
    return path, json.dumps(body).encode(), False


class HttpFuzzer:
    def __init__(self, port: int, tally: Tally):
        self.tally = tally
        self.base = f"http://127.0.0.1:{port}"

    def close(self) -> None:
        pass

    def _post(self, path: str, body: bytes) -> tuple[int, str]:
        request = urllib.request.Request(self.base + path, data=body, headers={"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(request, timeout=CALL_TIMEOUT_S) as response:
                return response.status, response.read().decode(errors="replace")
        except urllib.error.HTTPError as exc:
            return exc.code, exc.read().decode(errors="replace")

    def send(self, path: str, body: bytes, sane: bool) -> None:
        rpc = "chat" if "chat" in path else "completions"
        try:
            status, text = self._post(path, body)
        except (TimeoutError, urllib.error.URLError, ConnectionError) as exc:
            self.tally.record("http", rpc, "no-answer")
            self.tally.violate("http", rpc, f"no answer: {exc!r}", body)
            return
        self.tally.record("http", rpc, str(status))
        if status >= 500:
            self.tally.violate("http", rpc, f"{status}: {text[:300]}", body)
        elif sane and (status != 200 or ('"stream": true' in body.decode() and "[DONE]" not in text)
                       or '"error"' in text):
            self.tally.violate("http", rpc, f"a valid request got {status}: {text[:300]}", body)
        elif status != 200 and '"error"' not in text:
            self.tally.violate("http", rpc, f"{status} without an error body: {text[:300]}", body)
