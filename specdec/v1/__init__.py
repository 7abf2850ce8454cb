"""Generated gRPC/protobuf stubs of protos/specdec/v1 (built by setup.py, never edited)."""
