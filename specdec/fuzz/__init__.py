"""Fuzzing the services at depth, from the protobuf contract.

    python -m specdec.fuzz --service target --messages 10000

starts tiny in-process servers (`system`), draws messages from the contract
with hypothesis (`contract`, `services`, `front_doors`), holds every answer to
the oracles (`oracle`: no INTERNAL/UNKNOWN, no hang, valid calls succeed,
invalid ones are refused, a witness session is unaffected), and prints the
status counts (`run`). Needs the test extras (hypothesis).
"""
