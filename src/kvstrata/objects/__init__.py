"""KV objects: a block key, its representation, payload digest, metadata and lifecycle state.

Readers only ever see COMMITTED objects whose payload digest verified.
"""

from kvstrata.objects.model import (
    DIGEST_ALGORITHM,
    MALFORMED_META,
    IllegalTransition,
    KVObjectMeta,
    ObjectState,
    Representation,
    payload_digest,
    payload_hasher,
)

__all__ = [
    "DIGEST_ALGORITHM",
    "MALFORMED_META",
    "IllegalTransition",
    "KVObjectMeta",
    "ObjectState",
    "Representation",
    "payload_digest",
    "payload_hasher",
]
