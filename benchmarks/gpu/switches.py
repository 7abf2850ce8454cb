"""What the GPU run switches off for its later phases, from the pre-flight's
log (benchmarks/gpu/smoke.py): so a part that failed there stays off and the
later phases still measure the rest. check.sh reads one line per switch:
`NAME=VALUE<TAB>why`.

- the Triton attention kernel failed: SDPA attention and no fused layers
  (the fused layers use the kernel);
- else the default engine (graphs + fused layers) disagreed with the
  reference engine or failed: no fused layers. A failure of the reference
  engine itself is a check of its own and switches nothing off: no later
  phase runs it;
- the draft's steps run ahead drafted differently from stepping one at a
  time, or never ran ahead: run ahead off (not when the check itself broke);
- the draft's picks replayed as CUDA graphs gave other bits than the eager
  picks, or were not captured: pick graphs off (likewise).
"""
from __future__ import annotations

import sys


CHECKS = ("toolchain", "triton kernel vs float64 reference", "engine: reference (transformers+sdpa eager)",
          "engine: graphs+fused vs transformers+sdpa eager", "engine: host syncs per captured step",
          "draft: run ahead vs steps one at a time",
          "pick graphs: capture cost of a new shape")  # smoke.py's checks, in its order


def failed(log: str) -> dict[str, str]:
    """Each failed check's name and what it said (smoke.py prints `FAIL name: what`;
    a name may hold ": " itself)."""
    out = {}
    for line in log.splitlines():
        if line.startswith("FAIL "):
            rest = line[5:]
            name = next((c for c in CHECKS if rest.startswith(c + ":")), rest.partition(": ")[0])
            out[name] = rest[len(name) + 2:]
    return out


def switches(log: str) -> list[tuple[str, str]]:
    """(NAME=VALUE, why) for each switch the log calls for, in order."""
    fails = failed(log)
    out = []
    if "triton kernel vs float64 reference" in fails:
        out += [("SPECD_ATTENTION=sdpa", "the attention kernel failed"),
                ("SPECD_FUSED_LAYERS=off", "the attention kernel failed")]
    elif "engine: graphs+fused vs transformers+sdpa eager" in fails:
        out.append(("SPECD_FUSED_LAYERS=off", "the default engine failed"))
    said = fails.get("draft: run ahead vs steps one at a time", "")
    if "drafted differently" in said or "no step ran ahead" in said:
        out.append(("SPECD_RUN_AHEAD=off", "the draft's steps run ahead failed the pre-flight"))
    said = fails.get("pick graphs: capture cost of a new shape", "")
    if "replay != eager" in said or "captures for 4 shapes" in said:
        out.append(("SPECD_PICK_GRAPHS=off", "the draft's pick graphs failed the pre-flight"))
    return out


if __name__ == "__main__":
    try:
        text = open(sys.argv[1], encoding="utf-8", errors="replace").read()
    except OSError:
        text = ""  # no pre-flight log: nothing to switch off
    for assignment, why in switches(text):
        print(f"{assignment}\t{why}")
