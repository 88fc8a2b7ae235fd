"""The front door's disaggregation flags (``kvstrata up`` and ``kvstrata router``) and the
``DisaggSettings`` they make."""

from __future__ import annotations

import argparse
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from kvstrata.fleet.disagg import DisaggSettings


def disagg_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--link-gbps",
        type=float,
        default=None,
        help="disaggregated: the prefill→decode link's GB/s (default: a loopback socket "
        "measured once at start)",
    )
    parser.add_argument(
        "--disagg-interference-weight",
        type=float,
        default=1.0,
        help="disaggregated: weight of a second of delay to a running decode against a second "
        "of the new request's TTFT (router.disagg, default 1)",
    )


def disagg_settings(args: argparse.Namespace) -> DisaggSettings:
    """The link the front door prices transfers with: ``--link-gbps``, else measured now."""
    from kvstrata.fleet.disagg import DisaggSettings
    from kvstrata.router.disagg import DisaggConfig
    from kvstrata.router.disagg_inputs import Link
    from kvstrata.transfer.tcp import raw_socket_gbps

    if args.link_gbps is not None:
        link = Link(bytes_per_s=args.link_gbps * 1e9, source="configured")
    else:
        link = Link(bytes_per_s=raw_socket_gbps(64 * 1024 * 1024) * 1e9, source="measured")
    print(f"disaggregated: link {link.bytes_per_s / 1e9:.2f} GB/s ({link.source})", flush=True)
    return DisaggSettings(
        link=link, choice=DisaggConfig(interference_weight=args.disagg_interference_weight)
    )
