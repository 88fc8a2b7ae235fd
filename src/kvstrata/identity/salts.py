"""vLLM's ``cache_salt`` → a kvstrata tenant name (shared by the connector and the router).

Every salt is its own tenant: ``salt-<first 32 hex of BLAKE3(tag || salt)>``, so the salt itself
never reaches disk metadata, events or metrics. The connector keys a salted request's blocks
in that tenant's namespace; the router hashes a request with a ``cache_salt`` (and vLLM's
salted ``BlockStored`` events) in the same one, so both agree without sharing the salt.
"""

from __future__ import annotations

from blake3 import blake3

_SALT_TAG = b"kvstrata.vllm.cache_salt.v1\x00"


def salt_tenant(cache_salt: str) -> str:
    """The tenant name of a non-empty ``cache_salt``."""
    # surrogatepass: a JSON "\ud800" reaches here as a lone surrogate; valid text is unchanged
    digest = blake3(_SALT_TAG + cache_salt.encode("utf-8", "surrogatepass")).hexdigest()[:32]
    return f"salt-{digest}"
