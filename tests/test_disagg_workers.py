"""Disaggregated prefill between two real ``kvstrata serve`` processes (issue 14, items 3, 5).

A prefill worker (``POST /kv/prefill``) streams a prompt's KV layer by layer to a decode
worker's transfer port; the decode worker's completion (``kvstrata_transfer``) then hits the
received blocks. A sender SIGKILLed mid-transfer and a refused handshake both end in a local
prefill with the same answer, counted.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest

from kvstrata.runtime.processes import free_port
from kvstrata.serve.transfer_sender import UNREACHABLE
from kvstrata.transfer.handshake import (
    MAX_MESSAGE_BYTES,
    PROTOCOL_VERSION,
    BlockEntry,
    Operation,
    Refuse,
    TransferOffer,
    Transport,
    WireLayout,
    decode_answer,
    encode,
)
from kvstrata.transfer.intro import TransferIntro, encode_intro, intro_mac
from kvstrata.transfer.layout import KVLayout, RefuseReason
from kvstrata.transfer.tcp import TcpTransport
from socket_helpers import foreign_service

SECRET = b"disagg-test-secret"
BLOCK = 16
DELAY_S = 3.0  # wide margins around the kill (a loaded box answers the checks late)


pytestmark = pytest.mark.timeout(300)


class _Worker:
    """A ``kvstrata serve`` process on a free port (started, not yet waited for)."""

    def __init__(self, tmp_path: Path, name: str, *flags: str, model: str = "tiny") -> None:
        secret = tmp_path / "secret"
        secret.write_bytes(SECRET)
        port = free_port()
        self.log = tmp_path / f"{name}.log"
        command = [sys.executable, "-m", "kvstrata.cli.main", "serve", "--model", model]
        command += ["--port", str(port), "--pool-gib", "0.05", "--host-gib", "0.05"]
        command += ["--tenant-secret-file", str(secret), "--log-level", "warning", *flags]
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
        with self.log.open("ab") as out:
            self.process = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT, env=env)
        self.url = f"http://127.0.0.1:{port}"

    def wait_ready(self) -> None:
        _wait(lambda: _healthy(self.process, self.url, self.log), 240, f"{self.log} to start")

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.kill()
            self.process.wait(timeout=30)


@dataclass
class Workers:
    decode: _Worker
    prefill: _Worker
    slow_prefill: _Worker  # pauses before each layer it sends: killed mid-transfer
    decode_32: _Worker  # another block size: receives through a reblocking conversion


@pytest.fixture(scope="module")
def workers(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Workers]:
    from kvstrata.engine.model_loader import ensure_checkpoint

    ensure_checkpoint("tiny")
    tmp_path = tmp_path_factory.mktemp("disagg")
    started: list[_Worker] = []
    try:
        audit = tmp_path / "decode-audit.jsonl"
        started.append(
            _Worker(tmp_path, "decode", "--transfer-port", "0", "--audit-path", str(audit))
        )
        started.append(_Worker(tmp_path, "prefill"))
        started.append(_Worker(tmp_path, "slow", "--transfer-layer-delay-s", str(DELAY_S)))
        started.append(
            _Worker(tmp_path, "decode32", "--transfer-port", "0", "--block-size", str(2 * BLOCK))
        )
        for worker in started:  # all three start at once
            worker.wait_ready()
        yield Workers(*started)
    finally:
        for worker in started:
            worker.stop()


def _healthy(process: subprocess.Popen[bytes], url: str, log: Path) -> bool:
    assert process.poll() is None, f"serve exited early:\n{log.read_text()}"
    try:
        return httpx.get(f"{url}/health", timeout=2).status_code == 200
    except httpx.HTTPError:
        return False


def _wait(predicate: Callable[[], bool], timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)


def _transfer_info(url: str) -> dict[str, Any]:
    response = httpx.get(f"{url}/kv/info", timeout=10)
    assert response.status_code == 200, response.text
    info: dict[str, Any] = response.json()["transfer"]
    return info


def _complete(url: str, tokens: list[int], wait: dict[str, Any] | None = None) -> tuple[str, int]:
    body: dict[str, Any] = {"prompt": tokens, "max_tokens": 8, "temperature": 0}
    if wait is not None:
        body["kvstrata_transfer"] = wait
    response = httpx.post(f"{url}/v1/completions", json=body, timeout=120)
    assert response.status_code == 200, response.text
    return response.json()["choices"][0]["text"], int(response.headers["x-kvstrata-matched-tokens"])


def _prefill(url: str, request_id: str, tokens: list[int], info: dict[str, Any]) -> Any:
    body = {
        "request_id": request_id,
        "prompt_token_ids": tokens,
        "target": {"host": info["host"], "port": info["port"]},
    }
    response = httpx.post(f"{url}/kv/prefill", json=body, timeout=120)
    assert response.status_code == 200, response.text
    return response.json()


def _metric(url: str, name: str, **labels: str) -> float:
    wanted = ",".join(f'{k}="{v}"' for k, v in sorted(labels.items()))
    total = 0.0
    for line in httpx.get(f"{url}/metrics", timeout=10).text.splitlines():
        if not line.startswith(name + "{"):
            continue
        head, value = line.rsplit(" ", 1)
        present = head[len(name) + 1 : -1].split(",")
        if all(part in present for part in wanted.split(",")):
            total += float(value)
    return total


def _prompt(seed: int, length: int) -> list[int]:
    return [(seed * 7919 + i * 104729) % 97 + 3 for i in range(length)]


def test_transferred_prefill_is_a_hit_with_the_single_worker_answer(workers: Workers) -> None:
    decode, prefill = workers.decode.url, workers.prefill.url
    tokens = _prompt(1, 5 * BLOCK + 5)
    committed = _metric(decode, "kvstrata_transfers_total", outcome="committed")
    info = _transfer_info(decode)
    assert info["layout"]["block_size"] == BLOCK and len(info["model_digest"]) == 64
    sent = _prefill(prefill, "req-1", tokens, info)
    assert sent["outcome"] == "sent", sent
    assert sent["blocks"] == 5 and sent["bytes"] > 0 and 0.0 <= sent["overlap"] <= 1.0
    # its own compute, which the router fits the prefill worker from: not the transfer
    assert 0 < sent["prefill_compute_s"] <= sent["seconds"] and sent["matched_tokens"] == 0
    text, matched = _complete(decode, tokens, {"request_id": "req-1", "timeout_s": 30})
    assert matched == 5 * BLOCK  # the transferred blocks, through lookup and promotion
    single, _ = _complete(prefill, tokens)
    assert text == single
    assert _metric(decode, "kvstrata_transfers_total", outcome="committed") == committed + 1
    assert _metric(decode, "kvstrata_disagg_requests_total", path="transfer") >= 1
    assert _metric(prefill, "kvstrata_disagg_requests_total", outcome="sent") >= 1
    # a request no transfer reaches: it waits, times out and computes locally
    timeouts = _metric(decode, "kvstrata_disagg_requests_total", outcome="timeout")
    text, matched = _complete(decode, _prompt(2, 3 * BLOCK), {"request_id": "x", "timeout_s": 0.3})
    assert matched == 0
    assert _metric(decode, "kvstrata_disagg_requests_total", outcome="timeout") == timeouts + 1


def test_another_block_size_receives_through_a_conversion(workers: Workers) -> None:
    decode, prefill = workers.decode_32.url, workers.prefill.url
    tokens = _prompt(5, 5 * BLOCK + 5)
    info = _transfer_info(decode)
    assert info["layout"]["block_size"] == 2 * BLOCK
    sent = _prefill(prefill, "req-c", tokens, info)
    assert sent["outcome"] == "sent" and sent["blocks"] == 5, sent
    text, matched = _complete(decode, tokens, {"request_id": "req-c", "timeout_s": 30})
    assert matched == 4 * BLOCK  # five 16-token blocks reblocked into two of 32 (+16 dropped)
    assert text == _complete(prefill, tokens)[0]
    assert _metric(decode, "kvstrata_transfers_total", outcome="committed") == 1


def test_sender_sigkilled_mid_transfer_leaves_nothing_and_decode_computes(
    workers: Workers,
) -> None:
    decode, prefill = workers.decode.url, workers.slow_prefill.url
    tokens = _prompt(3, 4 * BLOCK)
    info = _transfer_info(decode)
    errors: list[BaseException] = []

    def post() -> None:
        try:
            _prefill(prefill, "req-k", tokens, info)
        except (httpx.HTTPError, AssertionError) as exc:
            errors.append(exc)

    thread = threading.Thread(target=post, daemon=True)
    thread.start()
    _wait(lambda: _transfer_info(decode)["active"] >= 1, 60, "the transfer to begin")
    time.sleep(DELAY_S * 1.5)  # layer 0 of 2 has gone, layer 1 not yet
    assert _transfer_info(decode)["active"] == 1
    sender = workers.slow_prefill.process
    sender.send_signal(signal.SIGKILL)
    sender.wait(timeout=30)
    thread.join(timeout=30)
    assert errors  # the prefill worker died: its reply never came
    text, matched = _complete(decode, tokens, {"request_id": "req-k", "timeout_s": 30})
    assert matched == 0  # nothing half-written is visible
    assert _metric(decode, "kvstrata_transfers_total", outcome="peer_lost") == 1
    assert _metric(decode, "kvstrata_disagg_requests_total", outcome="peer_lost") == 1
    assert _metric(decode, "kvstrata_transfer_bytes_total", outcome="peer_lost") > 0
    again, matched = _complete(decode, tokens)
    assert again == text and matched > 0  # its own local prefill, reused
    lines = [json.loads(x) for x in _audit_of(workers.decode).read_text().splitlines()]
    mine = [x for x in lines if x.get("request_id") == "req-k" and x["audit"] == "transfer"]
    assert {x["reason"] for x in mine} == {"peer_lost", "decode_local_peer_lost"}
    assert again == _complete(workers.prefill.url, tokens)[0]


def _audit_of(worker: _Worker) -> Path:
    path = worker.log.parent / "decode-audit.jsonl"
    _wait(lambda: path.is_file() and "decode_local_peer_lost" in path.read_text(), 30, "audit")
    return path


def _offer(
    info: dict[str, Any], request_id: str, tokens: list[int], model_digest: bytes = bytes(32)
) -> bytes:
    layout = KVLayout(**info["layout"])
    return encode(
        TransferOffer(
            version=PROTOCOL_VERSION,
            model_digest=model_digest,  # by default not the decode worker's model
            layout=WireLayout.of(layout),
            request_id=request_id,
            tenant="default",
            blocks=tuple(BlockEntry(i, BLOCK, bytes(32)) for i in range(len(tokens) // BLOCK)),
            operations=(Operation.WRITE,),
            transports=(Transport.TCP,),
        )
    )


def _handshake(
    info: dict[str, Any], request_id: str, tokens: list[int], secret: bytes, offer: bytes
) -> Any:
    conn = TcpTransport().connect((info["host"], info["port"]), timeout_s=10)
    try:
        mac = intro_mac(secret, request_id, "default", tokens)
        intro = TransferIntro(PROTOCOL_VERSION, request_id, tuple(tokens), "default", mac)
        conn.send_frame(encode_intro(intro))
        conn.send_frame(offer)
        return decode_answer(bytes(conn.recv_frame(timeout_s=10)), max_bytes=MAX_MESSAGE_BYTES)
    finally:
        conn.close()


def test_refused_handshake_falls_back_to_local_prefill_counted_with_reason(
    workers: Workers,
) -> None:
    tokens = _prompt(4, 2 * BLOCK)
    decode = workers.decode.url
    info = _transfer_info(decode)
    answer = _handshake(info, "req-r", tokens, SECRET, _offer(info, "req-r", tokens))
    assert isinstance(answer, Refuse) and answer.reason is RefuseReason.MODEL_MISMATCH
    # the right model, but a peer without the deployment's secret: refused before any write
    right = bytes.fromhex(info["model_digest"])
    forged = _handshake(info, "req-f", tokens, b"guess", _offer(info, "req-f", tokens, right))
    assert isinstance(forged, Refuse) and forged.reason is RefuseReason.TENANT_FORBIDDEN
    text, matched = _complete(decode, tokens, {"request_id": "req-r", "timeout_s": 10})
    assert matched == 0 and text == _complete(decode, tokens)[0]
    assert _metric(decode, "kvstrata_transfer_refusals_total", reason="model_mismatch") == 1
    assert _metric(decode, "kvstrata_disagg_requests_total", outcome="refused_model_mismatch") == 1


def test_prefill_to_a_target_outside_the_allow_list_is_refused_before_any_work(
    workers: Workers,
) -> None:
    """Default ``[transfer] allowed_targets`` is loopback: a worker told to stream KV to
    another address (a request forgery) answers 403, counts and computes nothing."""
    prefill = workers.prefill.url
    before = _metric(prefill, "kvstrata_disagg_requests_total", role="prefill")
    body = {
        "request_id": "req-ssrf",
        "prompt_token_ids": _prompt(5, 2 * BLOCK),
        "target": {"host": "169.254.169.254", "port": 80},
    }
    response = httpx.post(f"{prefill}/kv/prefill", json=body, timeout=30)
    assert response.status_code == 403, response.text
    error = response.json()["error"]
    assert error["code"] == "target_forbidden" and "allowed_targets" in error["message"]
    assert _metric(prefill, "kvstrata_transfer_refusals_total", reason="target_forbidden") == 1
    assert _metric(prefill, "kvstrata_disagg_requests_total", role="prefill") == before
    named = {**body, "target": {"host": "metadata.internal", "port": 80}}
    assert httpx.post(f"{prefill}/kv/prefill", json=named, timeout=30).status_code == 403


def test_a_target_that_is_no_transfer_listener_is_sent_nothing_and_described_to_nobody(
    workers: Workers,
) -> None:
    """``target`` is the caller's to name, and loopback is allowed by default: a worker sent
    to another local service (Valkey, an HTTP server) writes it nothing — the listener must
    greet first — and answers the same reason for that as for a closed port, with no byte of
    what the service sent."""
    closed = free_port()
    with foreign_service(b"HTTP/1.1 400 Bad Request\r\n\r\n", linger_s=5) as service:
        for port in (service.address[1], closed):
            body = {
                "request_id": "req-foreign",
                "prompt_token_ids": _prompt(6, 2 * BLOCK),
                "target": {"host": "127.0.0.1", "port": port},
            }
            response = httpx.post(f"{workers.prefill.url}/kv/prefill", json=body, timeout=60)
            assert response.status_code == 200, response.text
            answer = response.json()
            assert answer["outcome"] == "unreachable" and answer["reason"] == UNREACHABLE
            # a request id is logged and audited: one that could forge a line is refused
            forged = {**body, "request_id": "x\nINFO kvstrata.audit {}\r\nSET pwned 1"}
            response = httpx.post(f"{workers.prefill.url}/kv/prefill", json=forged, timeout=60)
            assert response.status_code == 400, response.text
            assert "request_id" in response.text
    assert service.received == b""


@pytest.mark.slow
def test_smollm2_disaggregated_greedy_output_is_exact(tmp_path: Path) -> None:
    from transformers import AutoTokenizer

    from kvstrata.engine.model_loader import ensure_checkpoint

    tokenizer = AutoTokenizer.from_pretrained(str(ensure_checkpoint("smollm2")))
    text = "The three primary colours of light are red, green and blue. Mixing all of them"
    tokens = [int(t) for t in tokenizer(text * 2)["input_ids"]]
    decode = _Worker(tmp_path, "smol-decode", "--transfer-port", "0", model="smollm2")
    prefill = _Worker(tmp_path, "smol-prefill", model="smollm2")
    try:
        decode.wait_ready()
        prefill.wait_ready()
        sent = _prefill(prefill.url, "smol-1", tokens, _transfer_info(decode.url))
        assert sent["outcome"] == "sent", sent
        out, matched = _complete(decode.url, tokens, {"request_id": "smol-1", "timeout_s": 60})
        assert matched == len(tokens) // BLOCK * BLOCK
        single, _ = _complete(prefill.url, tokens)
        assert out == single
    finally:
        decode.stop()
        prefill.stop()


@pytest.mark.slow
def test_nixl_carries_the_transfer_between_two_workers(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``[transfer] transport = "nixl"``: the decode worker's listener speaks NIXL (UCX writes
    into its registered ring, loopback here), ``/kv/info`` says so, the prefill worker connects
    with it; the answer equals the single worker's, and a TCP offer to it is refused."""
    from kvstrata.transfer.nixl_transport import available

    reason = available()
    if reason is not None:
        print(f"SKIP nixl: {reason}", file=sys.stderr)
        pytest.skip(reason)
    monkeypatch.setenv("UCX_NET_DEVICES", "lo")
    decode = _Worker(
        tmp_path, "decode-nixl", "--transfer-port", "0", "--transfer-transport", "nixl"
    )
    prefill = _Worker(tmp_path, "prefill-nixl")
    try:
        decode.wait_ready()
        prefill.wait_ready()
        info = _transfer_info(decode.url)
        assert info["transport"] == "nixl"
        tokens = _prompt(6, 4 * BLOCK + 3)
        body = {
            "request_id": "req-n",
            "prompt_token_ids": tokens,
            "target": {"host": info["host"], "port": info["port"], "transport": "nixl"},
        }
        sent = httpx.post(f"{prefill.url}/kv/prefill", json=body, timeout=120).json()
        assert sent["outcome"] == "sent", sent
        text, matched = _complete(decode.url, tokens, {"request_id": "req-n", "timeout_s": 30})
        assert matched == 4 * BLOCK and text == _complete(prefill.url, tokens)[0]
        assert (
            _metric(decode.url, "kvstrata_transfers_total", path="nixl", outcome="committed") == 1
        )
        tcp_body = {**body, "request_id": "req-t", "target": {**body["target"], "transport": "tcp"}}
        wrong = httpx.post(f"{prefill.url}/kv/prefill", json=tcp_body, timeout=120).json()
        assert wrong["outcome"] in ("failed", "unreachable", "refused"), wrong
        text, matched = _complete(decode.url, [*tokens[:-3], 7, 8, 9])
        assert text and matched == 4 * BLOCK  # the decode worker is unharmed, still serving hits
    finally:
        decode.stop()
        prefill.stop()
