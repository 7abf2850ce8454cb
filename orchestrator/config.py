"""Settings of the orchestrator role (flags / SPECD_* environment)."""
from __future__ import annotations

from dataclasses import dataclass

from specdec.config import opt
from specdec.limits import DEFAULT_MAX_DRAFT_TOKENS

DEFAULT_PORT = 50051


@dataclass
class OrchestratorConfig:
    draft: str = opt("127.0.0.1:50052", "draft service address host:port ('' runs without a draft)")
    target: str = opt("127.0.0.1:50053", "target service address host:port, a name that resolves to several replicas, "
                                         "or a comma-separated list of them")
    tokenizer: str = opt("", "tokenizer: catalog name or directory (default: the target's model)")
    policy: str = opt("fixed", "default policy choosing num_draft_tokens", choices=("fixed", "adaptive", "goodput"))
    num_draft_tokens: int = opt(4, "default num_draft_tokens of every round (fixed) or of the first (adaptive, goodput)")
    min_draft_tokens: int = opt(1, "adaptive, goodput: smallest num_draft_tokens")
    max_draft_tokens: int = opt(DEFAULT_MAX_DRAFT_TOKENS, "largest num_draft_tokens of one round (the services' own "
                                                          "limits cap it too); the adaptive policies' default bound")
    draft_min_confidence: float = opt(0.5, "end a round's drafting once the product of the draft model's "
                                           "probabilities of its drafts (its estimate that all will be accepted) "
                                           "is below this; num_draft_tokens is then the most a round drafts "
                                           "(goodput: its first round's threshold, then set from its timings, "
                                           "with up to max_draft_tokens). 0: never, in [0, 1]")
    pipeline: bool = opt(False, "pipelined drafting: draft the next round while the target verifies this one")
    pipeline_call_cost_ms: float = opt(2.0, "pipelining: the cost of one speculative Propose call (CPU on both ends), ms; "
                                       "drafting ahead happens when its expected saving is larger")
    pipeline_always: bool = opt(False, "pipelining: draft ahead in every round instead of when it is expected "
                                       "to pay (for measurements and tests)")
    call_streams: bool = opt(True, "send each round's ProposeAll and Verify as a message on one long-lived stream "
                                   "per service instead of as a unary call (unary against a service without them)")
    lanes: bool = opt(True, "send each round's ProposeAll and Verify on the service's lane (a TCP connection, TLS "
                            "when the channel is) when its ModelInfo advertises one, else by gRPC")
    batching: bool = opt(True, "batch verification across concurrent requests")
    speculation_gate: bool = opt(True, "at --gate-min-streams or more concurrent requests on a target replica, "
                                       "measure the aggregate tok/s with speculation and with plain decoding and "
                                       "run the faster (re-measuring the other now and then); off: always speculate")
    gate_min_streams: int = opt(2, "the speculation gate: fewest concurrent requests it decides for (below, every "
                                   "request speculates)")
    gate_epoch_ms: float = opt(250.0, "the speculation gate: shortest measuring epoch (it also counts 3 rounds per "
                                      "request), ms")
    gate_probe_cost: float = opt(0.03, "the speculation gate: the share of throughput that re-measuring the "
                                       "slower mode may cost (it is re-measured for one epoch once the faster has "
                                       "led long enough), in (0, 1]")
    max_batch: int = opt(16, "verify items per Verify RPC at most")
    max_batches_in_flight: int = opt(1, "Verify batches on their way to one target replica at once; more wait and "
                                         "merge (raise it when the network round trip is long next to the forward pass)")
    batch_window_ms: float = opt(2.0, "longest wait for more verify items, ms")
    default_max_tokens: int = opt(256, "max_tokens when a request leaves it 0")
    max_tokens_limit: int = opt(8192, "largest max_tokens a request may ask for")
    rpc_timeout_s: float = opt(60.0, "deadline of each downstream call, seconds")
    draft_retry_s: float = opt(2.0, "after a draft failure, re-open the request's draft session after this long, "
                                    "on another draft replica that is up when its own has not answered since, "
                                    "seconds")
    target_recovery_s: float = opt(30.0, "after a target failure, look this long for a replica to re-open the session "
                                         "on (a request's own deadline, when shorter, bounds it), seconds")
    health_interval_s: float = opt(1.0, "check the target and draft replicas' health this often: a replica that "
                                        "does not answer, or that failed and answers again as another model or "
                                        "with smaller limits (its ModelInfo is re-checked), gets no new requests, "
                                        "and readiness is NOT_SERVING while no target answers, seconds")
    resolve_interval_s: float = opt(10.0, "re-resolve the services' names this often to find replicas, seconds")
    connect_timeout_s: float = opt(600.0, "wait this long for a replica to answer: at start-up for the first "
                                          "of each service, and for each replica that joins later, seconds")
    # Security (docs/security.md): the services are dialed over mutual TLS
    # when a CA is given, and the front doors require an API key when any is.
    downstream_ca: str = opt("", "PEM CA bundle to verify the draft's and target's certificates with (TLS to them; "
                                 "checked against the host name of --draft / --target, not a replica's IP)")
    downstream_cert: str = opt("", "PEM client certificate the orchestrator presents to the services (mutual TLS)")
    downstream_key: str = opt("", "PEM private key of --downstream-cert")
    api_key_file: str = opt("", "file of API keys, one per line, any of which a client must send as "
                                "'authorization: Bearer KEY' (also: env SPECD_API_KEYS, comma-separated)")
