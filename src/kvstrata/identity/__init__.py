"""Identity: model fingerprints, tenant namespaces and chained block keys.

Pure code: imports no torch, does no I/O, and depends on nothing else of kvstrata but
``kvstrata.errors``.
"""

from kvstrata.identity.fingerprint import (
    AdapterIdentity,
    ModelDigest,
    ModelFacts,
    ModelFingerprint,
    ReuseDisabled,
    ReuseDisabledReason,
    build_fingerprint,
)
from kvstrata.identity.keys import (
    DEFAULT_TENANT,
    AdapterExtra,
    BlockExtras,
    BlockKey,
    ContentHash,
    FingerprintDigest,
    MultimodalExtra,
    NamespaceRoot,
    TenantNamespace,
    chain_keys,
    content_hash,
    namespace_root,
    secret_digest,
)

__all__ = [
    "DEFAULT_TENANT",
    "AdapterExtra",
    "AdapterIdentity",
    "BlockExtras",
    "BlockKey",
    "ContentHash",
    "FingerprintDigest",
    "ModelDigest",
    "ModelFacts",
    "ModelFingerprint",
    "MultimodalExtra",
    "NamespaceRoot",
    "ReuseDisabled",
    "ReuseDisabledReason",
    "TenantNamespace",
    "build_fingerprint",
    "chain_keys",
    "content_hash",
    "namespace_root",
    "secret_digest",
]
