"""Credential files: who else may write or read them.

A keys file or a secret (tenant secret, admin token, fleet key, server password) that every
user of the machine may *write* is refused: anyone could add a key of their own or replace
the secret with one they know (and so compute every tenant's keys). One every user may
*read* is only reported (a warning): a keys file holds hashes, and a secret's readers may be
meant to share it (a container's mounted volume); ``ssh`` is stricter, kvstrata says why.
"""

from __future__ import annotations

import logging
import stat
from pathlib import Path

from kvstrata.errors import ConfigError

logger = logging.getLogger("kvstrata.security")


def check_credential_file(path: Path, what: str, *, secret: bool) -> None:
    """Raise ``ConfigError`` when every user may write ``path``; warn when every user may
    read it and it is a ``secret``. A file that cannot be stat'ed is left to its reader."""
    try:
        mode = path.stat().st_mode
    except OSError:
        return
    if mode & stat.S_IWOTH:
        raise ConfigError(
            f"{what} {path} is writable by every user (anyone could replace it): chmod o-w it",
            source=str(path),
        )
    if secret and mode & stat.S_IROTH:
        logger.warning("%s %s is readable by every user: chmod o-r it", what, path)
