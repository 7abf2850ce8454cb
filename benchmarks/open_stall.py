"""How long does an open session's round wait while long prompts open?

    PYTHONPATH=. python benchmarks/open_stall.py [--prompts 8] [--prompt-tokens 1000] [--reps 3]

An in-process target service over a random-weight Qwen2 (6 layers, 512 wide,
float32, one torch thread: a 512-token prefill pass costs ~0.2 s on a 2-core
VM). One session decodes a token at a time (Decode, cut back to its prompt
each call) while `--prompts` other clients open sessions of `--prompt-tokens`
tokens at once, and 0.3 s later one more client a prompt of 16 tokens. Prints
one JSON line per rep: the burst's wall time and the opens' median (the
short one's included), the short open's time, the decodes' median when
nothing opens, and how many decodes ran during the burst with their median
and longest wait. A decode waits for the engine-thread jobs queued ahead of
it: since opens run one prefill pass per job (specdec/rpc/open_batcher.py),
at most one pass; the short open joins the running job's next pass.
"""
from __future__ import annotations

import argparse
import json
import statistics
import threading
import time

import torch
from transformers import AutoModelForCausalLM, Qwen2Config

from specdec.engine.config import EngineConfig
from specdec.engine.engine import ModelEngine
from specdec.v1 import common_pb2, target_pb2
from tests.harness import running_target

DEADLINE_S = 120.0
RUNNING_PROMPT = 64
SHORT_TOKENS, SHORT_AFTER_S = 16, 0.3  # the short open: its prompt, and when it comes after the long ones


def build_engine() -> ModelEngine:
    torch.set_num_threads(1)
    torch.manual_seed(0)
    cfg = Qwen2Config(vocab_size=4096, hidden_size=512, intermediate_size=1024, num_hidden_layers=6,
                      num_attention_heads=8, num_key_value_heads=2, max_position_embeddings=4096,
                      bos_token_id=1, eos_token_id=2)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32, attn_implementation="sdpa").eval()
    return ModelEngine(model, EngineConfig(dtype="float32", max_sessions=16, max_context=2048), name="open-stall")


def one_burst(stub, running: str, prompts: int, prompt_tokens: int) -> dict:
    waits, stop = [], threading.Event()

    def decode():
        while not stop.is_set():
            sent = time.perf_counter()
            stub.Decode(target_pb2.DecodeRequest(session_id=running, num_tokens=1, keep_length=RUNNING_PROMPT),
                        timeout=DEADLINE_S)
            waits.append((sent, time.perf_counter() - sent))

    decoder = threading.Thread(target=decode)
    decoder.start()
    time.sleep(0.5)
    opened: list[tuple[float, str]] = []
    start = time.perf_counter()

    def open_one(i: int):
        prompt = [3 + (i + j) % 4000 for j in range(prompt_tokens)]
        reply = stub.OpenSession(common_pb2.OpenSessionRequest(prompt_token_ids=prompt), timeout=DEADLINE_S)
        opened.append((time.perf_counter() - start, reply.session_id))

    def short_open():  # a short prompt arriving while the long ones are prefilled
        time.sleep(SHORT_AFTER_S)
        sent = time.perf_counter()
        reply = stub.OpenSession(common_pb2.OpenSessionRequest(prompt_token_ids=[4] * SHORT_TOKENS), timeout=DEADLINE_S)
        short.append(time.perf_counter() - sent)
        opened.append((time.perf_counter() - start, reply.session_id))

    short: list[float] = []
    clients = [threading.Thread(target=open_one, args=(i,)) for i in range(prompts)]
    clients.append(threading.Thread(target=short_open))
    for client in clients:
        client.start()
    for client in clients:
        client.join()
    end = time.perf_counter()
    time.sleep(0.3)
    stop.set()
    decoder.join()
    for _, session_id in opened:
        stub.CloseSession(common_pb2.CloseSessionRequest(session_id=session_id), timeout=DEADLINE_S)
    quiet = [w for sent, w in waits if sent < start]
    during = [w for sent, w in waits if start <= sent < end]
    return {"burst_s": round(end - start, 3), "opens_median_s": round(statistics.median(t for t, _ in opened), 3),
            "short_open_ms": round(1e3 * short[0], 1),
            "quiet_decode_median_ms": round(1e3 * statistics.median(quiet), 2), "decodes_during": len(during),
            "during_median_ms": round(1e3 * statistics.median(during), 2) if during else None,
            "during_max_ms": round(1e3 * max(during), 2) if during else None}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--prompts", type=int, default=8, help="sessions opened at once")
    parser.add_argument("--prompt-tokens", type=int, default=1000, help="tokens of each prompt (at most 2047)")
    parser.add_argument("--reps", type=int, default=3)
    args = parser.parse_args()
    with running_target(build_engine()) as (_, stub, _):
        running = stub.OpenSession(common_pb2.OpenSessionRequest(prompt_token_ids=[5] * RUNNING_PROMPT),
                                   timeout=DEADLINE_S).session_id
        for rep in range(args.reps):
            print(json.dumps({"rep": rep, **one_burst(stub, running, args.prompts, args.prompt_tokens)}), flush=True)


if __name__ == "__main__":
    main()
