"""Bytes on the wire and Verify throughput of the services (issue 3).

    python benchmarks/service_overhead.py [--target tiny|MODEL] [--num-draft-tokens 4]

The gRPC overhead per call and per round that this script also measured is
now `specd overhead` (specdec/bench/overhead.py), against bare grpcio calls
measured in the same run. What remains here, printed as Markdown tables:

2. Bytes on the wire (protobuf `SerializeToString` lengths; HTTP/2 and gRPC
   framing not counted) of one round at the Qwen vocabulary size (151936, so
   token ids take realistic varint widths), greedy and T=0.7 (q truncated to 32
   entries per drafted token), and per emitted token at acceptance rate a:
   E = (1 - a^(k+1)) / (1 - a) tokens per round.
3. Verify throughput with 1, 4 and 16 sessions per call (k drafts each, context
   lengths 50-300), through the server: on the tiny target, and on `--target`
   when it names a model in the cache (e.g. qwen2.5-coder-1.5b-instruct,
   loaded in --dtype with --threads threads).
"""
from __future__ import annotations

import argparse
import asyncio
import random
import statistics
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import grpc  # noqa: E402
import torch  # noqa: E402
from transformers import AutoModelForCausalLM, LlamaConfig, Qwen2Config  # noqa: E402

from draft_service.drafters import ModelDrafter  # noqa: E402
from draft_service.server import start_draft_service  # noqa: E402
from specdec.engine.config import EngineConfig  # noqa: E402
from specdec.engine.engine import ModelEngine  # noqa: E402
from specdec.rpc.model_service import SessionLimits  # noqa: E402
from specdec.rpc.serving import ServerConfig  # noqa: E402
from specdec.v1 import common_pb2, draft_pb2, draft_pb2_grpc, target_pb2, target_pb2_grpc  # noqa: E402
from target_service.server import start_target_service  # noqa: E402
from target_service.verifier import Verifier  # noqa: E402

DEADLINE_S = 120.0
QWEN_VOCAB = 151936
SAMPLED = common_pb2.SamplingParams(temperature=0.7)
GREEDY = common_pb2.SamplingParams()


# ------------------------------------------------------------------ plumbing


class Services:
    """A target and a draft service in a background event loop, with sync stubs."""

    def __init__(self, target_engine: ModelEngine, draft_engine: ModelEngine):
        limits = SessionLimits()
        self.verifier = Verifier(target_engine, limits.max_draft_tokens, limits.max_verify_batch)
        self.drafter = ModelDrafter(draft_engine, limits.max_draft_tokens)
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        cfg = ServerConfig(host="127.0.0.1", port=0)
        self.target = self._run(start_target_service(cfg, limits, lambda: self.verifier))
        self.draft = self._run(start_draft_service(cfg, limits, lambda: self.drafter))
        self.channels = [grpc.insecure_channel(f"127.0.0.1:{s.port}") for s in (self.target, self.draft)]
        self.target_stub = target_pb2_grpc.TargetServiceStub(self.channels[0])
        self.draft_stub = draft_pb2_grpc.DraftServiceStub(self.channels[1])

    def _run(self, coro):
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(DEADLINE_S)

    def open(self, prompt: list[int], sampling=GREEDY, seed: int = 1) -> tuple[str, str]:
        req = common_pb2.OpenSessionRequest(prompt_token_ids=prompt, sampling=sampling, seed=seed)
        return (self.target_stub.OpenSession(req, timeout=DEADLINE_S).session_id,
                self.draft_stub.OpenSession(req, timeout=DEADLINE_S).session_id)

    def close(self) -> None:
        for channel in self.channels:
            channel.close()
        for service in (self.target, self.draft):
            self._run(service.stop(0))
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(5)


def tiny_engine(vocab_size: int = 128, seed: int = 0, arch: str = "llama") -> ModelEngine:
    torch.manual_seed(seed)
    common = dict(vocab_size=vocab_size, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024,
                  initializer_range=0.3, bos_token_id=1, eos_token_id=2, pad_token_id=0)
    config = Qwen2Config(**common) if arch == "qwen2" else LlamaConfig(**common)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32, attn_implementation="sdpa").eval()
    return ModelEngine(model, EngineConfig(dtype="float32", max_kv_bytes=1 << 30), name=f"tiny-{arch}-v{vocab_size}")


def tokens(n: int, vocab: int, rng: random.Random) -> list[int]:
    return [rng.randrange(3, vocab) for _ in range(n)]


def ms(seconds: float) -> str:
    return f"{seconds * 1e3:.3f}"


# ---------------------------------------------------------------- 2. bytes


def measure_bytes(services: Services, k: int, acceptance: float) -> list[list[str]]:
    """One steady-state round (rollback and the last emitted token riding on both calls)."""
    rng = random.Random(1)
    vocab = services.verifier.info.vocab_size
    expected = (1 - acceptance ** (k + 1)) / (1 - acceptance)
    rows = []
    for label, sampling in (("greedy", GREEDY), ("T=0.7", SAMPLED)):
        prompt = tokens(200, vocab, rng)
        t_sid, d_sid = services.open(prompt, sampling, seed=rng.getrandbits(64))
        last = rng.randrange(3, vocab)  # the previous round's recovery or bonus token
        n = len(prompt) - 1
        propose_req = draft_pb2.ProposeRequest(session_id=d_sid, keep_length=n, append_token_ids=[last],
                                               num_draft_tokens=k)
        stream = list(services.draft_stub.Propose(propose_req, timeout=DEADLINE_S))
        item = target_pb2.VerifyItem(session_id=t_sid, keep_length=n, append_token_ids=[last],
                                     draft_token_ids=[d.token_id for d in stream],
                                     draft_q=[d.q for d in stream if d.HasField("q")])
        verify_req = target_pb2.VerifyRequest(items=[item])
        verify_reply = services.target_stub.Verify(verify_req, timeout=DEADLINE_S)
        assert not verify_reply.results[0].HasField("error"), verify_reply.results[0].error
        sizes = dict(
            propose_req=len(propose_req.SerializeToString()),
            propose_stream=sum(len(d.SerializeToString()) for d in stream),
            verify_req=len(verify_req.SerializeToString()),
            verify_reply=len(verify_reply.SerializeToString()),
        )
        verify_bytes = sizes["verify_req"] + sizes["verify_reply"]
        total = verify_bytes + sizes["propose_req"] + sizes["propose_stream"]
        q_entries = sum(len(d.q.token_ids) for d in stream)
        rows.append([label, str(q_entries), str(sizes["verify_req"]), str(sizes["verify_reply"]),
                     str(sizes["propose_req"]), str(sizes["propose_stream"]), str(total),
                     f"{verify_bytes / expected:.0f}", f"**{total / expected:.0f}**"])
    return rows


# ----------------------------------------------------------- 3. throughput


def measure_throughput(services: Services, k: int, batch_sizes, reps: int, label: str) -> list[list[str]]:
    rng = random.Random(2)
    vocab = services.verifier.info.vocab_size
    sessions = []
    for _ in range(max(batch_sizes)):
        prompt = tokens(rng.randint(50, 300), vocab, rng)
        req = common_pb2.OpenSessionRequest(prompt_token_ids=prompt)
        sid = services.target_stub.OpenSession(req, timeout=DEADLINE_S).session_id
        sessions.append((sid, len(prompt)))
    rows = []
    for batch in batch_sizes:
        items = [target_pb2.VerifyItem(session_id=sid, keep_length=n, draft_token_ids=tokens(k, vocab, rng))
                 for sid, n in sessions[:batch]]
        req = target_pb2.VerifyRequest(items=items)
        services.target_stub.Verify(req, timeout=DEADLINE_S)  # warm-up
        times, server = [], []
        for _ in range(reps):
            start = time.perf_counter()
            reply = services.target_stub.Verify(req, timeout=DEADLINE_S)
            times.append(time.perf_counter() - start)
            server.append(reply.compute_micros * 1e-6)
            assert reply.batch_size == batch, [r.error for r in reply.results]
        call = statistics.median(times)
        rows.append([label, str(batch), ms(call), ms(statistics.median(server)), f"{batch / call:.3g}",
                     f"{batch * (k + 1) / call:.3g}"])
    return rows


def table(header: list[str], rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    lines += ["| " + " | ".join(row) + " |" for row in rows]
    return "\n".join(lines)


def real_target(name: str, dtype: str, threads: int) -> ModelEngine | None:
    from specdec.models.cache import resolve_model

    try:
        path = resolve_model(name)
    except Exception as exc:  # noqa: BLE001 - not cached: skip, and say so
        print(f"\n(skipping the real target: {exc})")
        return None
    engine = ModelEngine.load(EngineConfig(model=str(path), dtype=dtype, threads=threads, max_kv_bytes=4 << 30))
    engine.warmup()
    return engine


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--target", default="tiny",
                        help="tiny, or a cached model for the throughput table (e.g. qwen2.5-coder-1.5b-instruct)")
    parser.add_argument("--num-draft-tokens", type=int, default=4, help="tokens drafted per round")
    parser.add_argument("--reps", type=int, default=300, help="sets the tiny throughput's calls (reps / 5, at least 20)")
    parser.add_argument("--acceptance", type=float, default=0.8, help="acceptance rate for bytes per token")
    parser.add_argument("--dtype", default="bfloat16", help="dtype of the real target")
    parser.add_argument("--threads", type=int, default=2, help="CPU threads for forward passes")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    k = args.num_draft_tokens
    print(f"# Service overhead (k={k}, torch {torch.__version__}, grpcio {grpc.__version__}, "
          f"{args.threads} threads)\n")

    services = Services(tiny_engine(seed=0), tiny_engine(seed=1))
    try:
        tiny_rows = measure_throughput(services, k, (1, 4, 16), max(args.reps // 5, 20), "tiny (fp32)")
    finally:
        services.close()

    services = Services(tiny_engine(QWEN_VOCAB, seed=0, arch="qwen2"), tiny_engine(QWEN_VOCAB, seed=1, arch="qwen2"))
    try:
        rows = measure_bytes(services, k, args.acceptance)
    finally:
        services.close()
    expected = (1 - args.acceptance ** (k + 1)) / (1 - args.acceptance)
    print(f"\n## Bytes per round at vocab {QWEN_VOCAB}, k={k}; per emitted token at a={args.acceptance} "
          f"(E = {expected:.3f} tokens/round)\n")
    print(table(["sampling", "q entries", "Verify req", "Verify reply", "Propose req", "Propose stream",
                 "round total", "B/token (Verify only)", "B/token (round)"], rows))

    throughput = tiny_rows
    if args.target != "tiny":
        engine = real_target(args.target, args.dtype, args.threads)
        if engine is not None:
            services = Services(engine, tiny_engine(engine.vocab_size, seed=1))
            try:
                throughput += measure_throughput(services, k, (1, 4, 16), 5,
                                                 f"{args.target} ({args.dtype}, {args.threads} threads)")
            finally:
                services.close()
    print(f"\n## Verify throughput through the server (k={k}, contexts 50-300, greedy)\n")
    print(table(["target", "sessions/call", "call ms", "server compute ms", "items/s", "tokens scored/s"],
                throughput))


if __name__ == "__main__":
    main()
