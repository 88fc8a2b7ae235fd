"""Prefill → decode transfer: layouts and conversion plans, the compatibility handshake,
layout conversion, layer-wise streaming with digests, and transports (docs/architecture.md).

This package file imports nothing, so that pure callers (the router's qualified local path)
can import ``kvstrata.transfer.layout`` without pulling in the store or torch."""
