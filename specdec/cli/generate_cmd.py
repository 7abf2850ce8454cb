"""`specd generate PROMPT`: stream a generation from an orchestrator."""
from __future__ import annotations

import argparse
import json
import os
import sys

import grpc
from google.protobuf.json_format import MessageToDict

from specdec.cli.exits import EXIT_ERROR, EXIT_OK, EXIT_USAGE
from specdec.cli.flag_types import INT32_MAX, UINT64_MAX, check_utf8, duration, int_in, utf8_text


def register(sub) -> None:
    p = sub.add_parser("generate", help="stream a generation from an orchestrator")
    p.add_argument("prompt", nargs="?", default=None, type=utf8_text,
                   help="the prompt text ('-' reads standard input)")
    p.add_argument("--prompt-ids", type=_token_ids, default=None, metavar="ID,ID,...",
                   help="a pre-tokenized prompt instead of text: comma-separated token ids (e.g. 1,2,3)")
    p.add_argument("--server", default="127.0.0.1:50051", help="orchestrator address (default 127.0.0.1:50051)")
    p.add_argument("--chat", action="store_true", help="send the prompt as a user message (chat template)")
    p.add_argument("--max-tokens", type=int_in(0, INT32_MAX, "0: the server's default"), default=128)
    p.add_argument("--temperature", type=float, default=None, help="0: greedy (default: the server's, 1.0)")
    p.add_argument("--top-k", type=int_in(0, INT32_MAX, "0: off"), default=0)
    p.add_argument("--top-p", type=float, default=None)
    p.add_argument("--seed", type=int_in(0, UINT64_MAX), default=None)
    p.add_argument("--stop", action="append", default=[], type=utf8_text, help="stop string (repeatable)")
    p.add_argument("--policy", default="", type=utf8_text,
                   help="policy choosing num_draft_tokens: fixed, adaptive or goodput (default: the server's)")
    p.add_argument("--pipeline", action=argparse.BooleanOptionalAction, default=None,
                   help="pipelined drafting on/off for this request (default: the server's)")
    p.add_argument("--num-draft-tokens", type=int_in(0, INT32_MAX, "0: the server's default"), default=0,
                   help="tokens drafted per round (default: the server's)")
    p.add_argument("--draft-min-confidence", type=float, default=None, metavar="P",
                   help="end a round's drafting once the product of the draft's probabilities of its "
                        "drafts is below P, in [0, 1] (0: never; default: the server's)")
    p.add_argument("--no-speculation", action="store_true", help="decode with the target alone")
    p.add_argument("--stats", action="store_true", help="print the request's statistics to stderr")
    p.add_argument("--json", action="store_true", help="print one JSON object with the text and statistics")
    p.add_argument("--timeout", type=duration, default=600.0, help="deadline of the request, seconds")
    p.add_argument("--wait", type=duration, default=0.0, metavar="SECONDS",
                   help="wait up to this long for the server to come up (e.g. while `specd up` loads)")
    security = p.add_argument_group("security (docs/security.md)")
    security.add_argument("--api-key", default=os.environ.get("SPECD_API_KEY"),
                          help="API key, sent as 'authorization: Bearer KEY' [env SPECD_API_KEY]")
    security.add_argument("--ca-cert", default=os.environ.get("SPECD_CA_CERT", ""),
                          help="PEM CA certificate to verify the orchestrator with: speak TLS [env SPECD_CA_CERT]")
    security.add_argument("--client-cert", default=os.environ.get("SPECD_CLIENT_CERT", ""),
                          help="PEM client certificate, when the orchestrator asks for one [env SPECD_CLIENT_CERT]")
    security.add_argument("--client-key", default=os.environ.get("SPECD_CLIENT_KEY", ""),
                          help="PEM private key of --client-cert [env SPECD_CLIENT_KEY]")
    p.set_defaults(func=run)


def _token_ids(text: str) -> list[int]:
    try:
        ids = [int(part) for part in text.replace(" ", "").split(",") if part]
    except ValueError:
        raise argparse.ArgumentTypeError(f"token ids must be comma-separated integers, got {text!r}") from None
    if not ids:
        raise argparse.ArgumentTypeError("no token ids given")
    bad = next((i for i in ids if not 0 <= i <= INT32_MAX), None)
    if bad is not None:
        raise argparse.ArgumentTypeError(f"token ids must be in [0, {INT32_MAX}], got {bad}")
    return ids


def run(args: argparse.Namespace) -> int:
    from orchestrator.client import Client
    from specdec.security.tls import ClientTls

    if (args.prompt is None) == (args.prompt_ids is None):
        print("specd generate: give a prompt, or --prompt-ids, not both", file=sys.stderr)
        return EXIT_USAGE
    if args.prompt_ids is not None and args.chat:
        print("specd generate: --chat needs a text prompt, not --prompt-ids", file=sys.stderr)
        return EXIT_USAGE
    try:
        request = _request(args)
    except ValueError as exc:
        print(f"specd generate: error: {exc}", file=sys.stderr)
        return EXIT_USAGE
    text, tokens = [], []
    timeout = args.timeout + args.wait
    tls = ClientTls(ca=args.ca_cert, cert=args.client_cert, key=args.client_key)
    try:
        tls.validate("--ca-cert/--client-cert/--client-key")
    except ValueError as exc:
        print(f"specd generate: {exc}", file=sys.stderr)
        return EXIT_USAGE
    # Client waits (within --wait) for the server, and for an orchestrator
    # still connecting to its services.
    with Client(args.server, timeout_s=timeout, wait_for_ready=args.wait > 0, api_key=args.api_key, tls=tls) as client:
        try:
            for chunk in client.generate(request):
                text.append(chunk.text)
                tokens.extend(chunk.token_ids)
                if not args.json:
                    sys.stdout.write(chunk.text)
                    sys.stdout.flush()
        except grpc.RpcError as exc:
            print(f"\nspecd: {exc.code().name}: {exc.details()}", file=sys.stderr)
            return EXIT_ERROR
        stats = MessageToDict(client.last_stats, preserving_proto_field_name=True) if client.last_stats else {}
    if args.json:
        print(json.dumps({"text": "".join(text), "token_ids": tokens, "stats": stats}, indent=2))
    else:
        print()
        if args.stats:
            print(json.dumps(stats, indent=2), file=sys.stderr)
    return EXIT_OK


def _request(args: argparse.Namespace):
    """The GenerateRequest for Client.generate, built and checked here:
    the flags' types caught most mistakes; what they cannot see (standard
    input that is not UTF-8, anything the request still refuses) raises
    ValueError, before a connection is made."""
    from orchestrator.client import build_request

    if args.prompt_ids is not None:
        prompt = args.prompt_ids
    elif args.prompt == "-":
        try:
            prompt = sys.stdin.read()
        except UnicodeDecodeError:
            raise ValueError("standard input is not valid UTF-8: pass UTF-8 text") from None
        check_utf8(prompt, "standard input")
    else:
        prompt = args.prompt
    if args.chat:
        prompt = [{"role": "user", "content": prompt}]
    kwargs = dict(max_tokens=args.max_tokens, temperature=args.temperature, top_k=args.top_k, top_p=args.top_p,
                  seed=args.seed, stop=args.stop, policy=args.policy, num_draft_tokens=args.num_draft_tokens,
                  speculate=not args.no_speculation, pipeline=args.pipeline,
                  draft_min_confidence=args.draft_min_confidence)
    return build_request(prompt, **kwargs)  # protobuf's own checks (ValueError): the last word before the call
