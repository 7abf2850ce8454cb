"""`python -m specdec.fuzz`: the full fuzz run (see specdec/fuzz/__init__.py)."""
from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import time

from specdec.fuzz import system
from specdec.fuzz.oracle import Tally
from specdec.fuzz.run import SERVICES, fuzz_service


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m specdec.fuzz", description=__doc__)
    parser.add_argument("--service", action="append", choices=SERVICES,
                        help="service to fuzz (repeatable; default: target, draft, orchestrator)")
    parser.add_argument("--messages", type=int, default=int(os.environ.get("SPECD_FUZZ_MESSAGES", "10000")),
                        help="messages to send to each service at least (env SPECD_FUZZ_MESSAGES)")
    parser.add_argument("--seed", type=int, default=0, help="hypothesis seed of the first round")
    parser.add_argument("--json", metavar="FILE", help="also write the summary as JSON here")
    parser.add_argument("--draft-run-ahead", choices=("auto", "on", "off"), default="auto",
                        help="the model drafter's --run-ahead (auto: off on the CPU; on: its steps run ahead, "
                        "as on a GPU)")
    args = parser.parse_args(argv)
    chosen = tuple(args.service or ("target", "draft", "orchestrator"))
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    import torch

    torch.set_num_threads(1)
    started = time.monotonic()
    roles = (*chosen, "orchestrator") if {"orchestrator", "http"} & set(chosen) else chosen
    tally = Tally()
    runs = []
    with system.start(roles, http="http" in chosen, draft_run_ahead=args.draft_run_ahead) as running:
        print(f"servers up in {time.monotonic() - started:.1f} s", flush=True)
        for service in chosen:
            runs.append(fuzz_service(running, service, args.messages, tally, seed=args.seed))
            print(json.dumps(runs[-1]), flush=True)
    print(tally.report())
    summary = {"command": " ".join(["python -m specdec.fuzz", *(argv if argv is not None else sys.argv[1:])]),
               "runs": runs, "statuses": {s: dict(tally.by_status(s)) for s in chosen},
               "verify_items": {k[1]: v for k, v in tally.item_counts.items()},
               "violations": [str(v) for v in tally.violations],
               "wall_s": round(time.monotonic() - started, 1)}
    if args.json:
        with open(args.json, "w") as f:
            json.dump(summary, f, indent=1)
    return 1 if tally.violations else 0


if __name__ == "__main__":
    sys.exit(main())
