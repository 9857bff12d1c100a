"""Triton gRPC/HTTP clients for a served dflash model repository (dflash-client, dflash-bench)."""
