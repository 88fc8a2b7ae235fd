"""``bench.transfer_link``: the transfer stack alone on loopback, beside a raw socket."""

from __future__ import annotations

import math

from kvstrata.bench.transfer_link import transfer_stack_gbps


def test_probe_commits_every_block_and_reports_consistent_figures() -> None:
    probe = transfer_stack_gbps(blocks=40, layers=3, layer_bytes=4096)
    assert probe.payload_bytes == 40 * 3 * 4096
    assert probe.seconds > 0 and probe.stack_gbps > 0 and probe.raw_socket_gbps > 0
    assert math.isclose(probe.stack_gbps, probe.payload_bytes / probe.seconds / 1e9)
    assert math.isclose(probe.stack_vs_raw, probe.stack_gbps / probe.raw_socket_gbps)
