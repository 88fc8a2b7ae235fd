"""Crash safety of the disk tier with real processes killed by SIGKILL at random points.

A child process stores objects in a loop and prints each key after ``complete_store`` returned
True; it writes in 4 KiB syscalls so that a kill can land inside an object. The parent kills
it after a random number of commits plus a random delay (so kills land
anywhere: mid-write, mid-fsync, between rename and directory fsync, during recovery), then
reopens the directory: nothing torn may be visible (recovery finds no invalid ``.kv`` file,
every visible object verifies and has exactly the bytes its key implies), and every key the
child reported is found again.
"""

from __future__ import annotations

import hashlib
import queue
import random
import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

from kvstrata.identity import BlockKey
from kvstrata.objects import payload_digest
from kvstrata.tiers.disk import DiskTier

CAPACITY = 1 << 30

_CHILD = textwrap.dedent(
    """
    import hashlib, os, sys, time
    from kvstrata.identity import BlockKey
    from kvstrata.objects import KVObjectMeta, Representation, payload_digest
    from kvstrata.tiers import disk_format
    from kvstrata.tiers.disk import DiskTier

    def chunked_write_all(fd, head, payload):
        # A slow medium: one writev per object would finish between two kill points, and a
        # torn file would need a kill inside a syscall. 4 KiB writes with pauses make every
        # object span many syscalls and most of the loop's time, so kills land inside objects.
        data = memoryview(head + bytes(payload))
        for start in range(0, len(data), 4096):
            os.write(fd, data[start : start + 4096])
            time.sleep(0.0002)

    disk_format.write_all = chunked_write_all
    tier = DiskTier(sys.argv[1], int(sys.argv[2]))
    print("ready", flush=True)
    while True:
        key = os.urandom(32)
        size = 1024 + int.from_bytes(key[:2], "little") * 4
        payload = hashlib.shake_128(key).digest(size)
        meta = KVObjectMeta(
            key=BlockKey(key), parent=None, tenant="crash",
            representation=Representation("uint8", "raw", 1, (size,)), size=size,
            digest=payload_digest(payload), created_at=0.0,
        )
        slot = tier.prepare_store(meta)
        slot.buffer[:] = payload
        if tier.complete_store(slot, True):
            print(key.hex(), flush=True)
    """
)


def expected_payload(key: bytes) -> bytes:
    size = 1024 + int.from_bytes(key[:2], "little") * 4
    return hashlib.shake_128(key).digest(size)


def _pump(stream: object, lines: queue.Queue[str | None]) -> None:
    for line in stream:  # type: ignore[attr-defined]
        lines.put(line.strip())
    lines.put(None)


def _run_and_kill(root: Path, commits_before_kill: int, extra_delay_s: float) -> list[str]:
    """Start a writer, SIGKILL it at the chosen point; returns the keys it reported committed."""
    proc = subprocess.Popen(
        [sys.executable, "-c", _CHILD, str(root), str(CAPACITY)],
        stdout=subprocess.PIPE,
        text=True,
    )
    lines: queue.Queue[str | None] = queue.Queue()
    reader = threading.Thread(target=_pump, args=(proc.stdout, lines), daemon=True)
    reader.start()
    committed: list[str] = []
    try:
        assert lines.get(timeout=30) == "ready"
        while len(committed) < commits_before_kill:
            line = lines.get(timeout=30)
            assert line is not None, "writer died on its own"
            committed.append(line)
        time.sleep(extra_delay_s)  # not synchronisation: picks a random point to kill at
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=30)
        reader.join(timeout=30)
    while (line := lines.get_nowait()) is not None:
        committed.append(line)
    assert proc.returncode == -signal.SIGKILL
    # A line cut short by the kill still names an object committed before it; skip it.
    return [line for line in committed if len(line) == 64]


def test_sigkill_never_leaves_torn_objects(tmp_path: Path) -> None:
    rng = random.Random(20240613)
    reported: set[str] = set()
    temp_files_seen = 0
    for kills in range(1, 15):
        reported.update(_run_and_kill(tmp_path, rng.randrange(0, 12), rng.uniform(0, 0.03)))
        with DiskTier(tmp_path, CAPACITY) as tier:
            assert tier.recovery.invalid == 0, "a torn or corrupt object file became visible"
            temp_files_seen += tier.recovery.temp_removed
            visible = {key.hex() for key in list(tier.keys())}
            missing = reported - visible
            assert not missing, f"{len(missing)} committed objects lost after SIGKILL"
            # At most one write per kill can be complete on disk but not yet reported.
            assert len(visible - reported) <= kills
            for hexkey in visible:
                lease = tier.prepare_load(BlockKey(bytes.fromhex(hexkey)))
                assert lease is not None, "a visible object failed verification"
                assert payload_digest(lease.buffer) == lease.meta.digest
                assert bytes(lease.buffer) == expected_payload(bytes.fromhex(hexkey))
                tier.complete_load(lease)
            assert tier.counters.invalidated == 0
            assert not list(tmp_path.glob("objects/*/*.tmp"))
    assert reported, "the writer never committed anything"
    assert temp_files_seen, "no kill landed inside a write: the test lost its power"
