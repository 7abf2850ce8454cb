"""Generate the Python gRPC/protobuf stubs of `protos/` into the source tree.

    python -m specdec.protogen

The stubs land next to the .proto packages (`specdec/v1/*_pb2*.py`) and are
ignored by git: they are build outputs, never edited by hand. `pip install`
runs this through setup.py.
"""
from __future__ import annotations

import pathlib
import sys


def generate(proto_root: pathlib.Path, out_root: pathlib.Path) -> list[pathlib.Path]:
    from grpc_tools import protoc  # build-time dependency
    import importlib.resources

    protos = sorted(proto_root.rglob("*.proto"))
    if not protos:
        raise SystemExit(f"no .proto files under {proto_root}")
    well_known = str(importlib.resources.files("grpc_tools") / "_proto")
    args = [
        "grpc_tools.protoc",
        f"-I{proto_root}",
        f"-I{well_known}",
        f"--python_out={out_root}",
        f"--pyi_out={out_root}",
        f"--grpc_python_out={out_root}",
        *[str(p.relative_to(proto_root)) for p in protos],
    ]
    if protoc.main(args) != 0:
        raise SystemExit("protoc failed on " + ", ".join(map(str, protos)))
    return protos


def main() -> None:
    root = pathlib.Path(__file__).resolve().parent.parent
    protos = generate(root / "protos", root)
    print(f"generated stubs for {len(protos)} proto files", file=sys.stderr)


if __name__ == "__main__":
    main()
