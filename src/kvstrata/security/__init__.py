"""Security: who a caller is (API keys → principals), what it may do (roles), and the audit
trail of what was refused, deleted, evicted or invalidated. See ``docs/security.md``."""

from kvstrata.security.audit import NULL_AUDIT, Action, AuditLog
from kvstrata.security.config import SecurityConfig
from kvstrata.security.keys import (
    ADMINISTER,
    ANONYMOUS,
    DUMP,
    OBSERVE,
    Authenticator,
    Principal,
    Role,
    generate_api_key,
    hash_api_key,
)

__all__ = [
    "ADMINISTER",
    "ANONYMOUS",
    "DUMP",
    "NULL_AUDIT",
    "OBSERVE",
    "Action",
    "AuditLog",
    "Authenticator",
    "Principal",
    "Role",
    "SecurityConfig",
    "generate_api_key",
    "hash_api_key",
]
