"""A minimal P/D proxy in front of two vLLM servers with the kvstrata connector.

The producer (``kv_role="kv_producer"``) gets the request with ``max_tokens=1`` and
``kv_transfer_params={"do_remote_decode": true}``: it prefills, saves the prompt's full blocks
through kvstrata's shared tier and answers with ``kv_transfer_params`` carrying a kvstrata offer
(``connectors/vllm_pd.py``). The consumer (``kv_role="kv_consumer"``) gets the original request
plus those params: it checks the offer, waits until the blocks are stored, loads them and
decodes. A producer that fails or answers without params costs only the remote prefill: the
consumer then prefills locally, with the same answer.

``pd_request`` is the function (tests, scripts); ``create_app`` an OpenAI-compatible app for
``/v1/completions`` and ``/v1/chat/completions`` (non-streaming answers); run it with
``python -m kvstrata.fleet.vllm_pd_proxy --producer URL --consumer URL [--port 8100]``.
The reference fleet's own disaggregated path (``disagg_proxy``) is the reference engine's
(``/kv/prefill`` + a TCP stream), not this one.
"""

from __future__ import annotations

import argparse
import logging
from typing import Any

import httpx

_log = logging.getLogger(__name__)
PRODUCE = {"do_remote_decode": True}


def prefill_body(body: dict[str, Any]) -> dict[str, Any]:
    """The producer's copy of a request: one token, no stream, asking for an offer."""
    prefill = {k: v for k, v in body.items() if k not in ("max_completion_tokens", "stream")}
    prefill.update(max_tokens=1, kv_transfer_params=dict(PRODUCE))
    prefill.pop("stream_options", None)
    return prefill


def pd_request(
    client: httpx.Client,
    producer: str,
    consumer: str,
    body: dict[str, Any],
    *,
    path: str = "/v1/completions",
) -> tuple[httpx.Response, dict[str, Any] | None]:
    """Prefill on ``producer``, decode on ``consumer``: the consumer's response and the
    ``kv_transfer_params`` the producer returned (None: it failed or returned none)."""
    params: dict[str, Any] | None = None
    try:
        first = client.post(producer.rstrip("/") + path, json=prefill_body(body))
        first.raise_for_status()
        returned = first.json().get("kv_transfer_params")
        params = returned if isinstance(returned, dict) else None
    except (httpx.HTTPError, ValueError) as exc:
        _log.warning("P/D proxy: the producer failed (%s); the consumer prefills locally", exc)
    decode = dict(body)
    if params is not None:
        decode["kv_transfer_params"] = params
    return client.post(consumer.rstrip("/") + path, json=decode), params


def create_app(producer: str, consumer: str, *, timeout_s: float = 300.0) -> Any:
    from fastapi import FastAPI, Request
    from fastapi.responses import JSONResponse
    from starlette.concurrency import run_in_threadpool

    app = FastAPI(title="kvstrata vLLM P/D proxy")
    client = httpx.Client(timeout=timeout_s)

    async def forward(request: Request, path: str) -> JSONResponse:
        body = await request.json()
        if not isinstance(body, dict):
            return JSONResponse({"error": "a JSON object is expected"}, status_code=400)
        body.pop("stream", None)
        answer = await run_in_threadpool(pd_request, client, producer, consumer, body, path=path)
        response = answer[0]
        return JSONResponse(response.json(), status_code=response.status_code)

    @app.post("/v1/completions")
    async def completions(request: Request) -> JSONResponse:
        return await forward(request, "/v1/completions")

    @app.post("/v1/chat/completions")
    async def chat(request: Request) -> JSONResponse:
        return await forward(request, "/v1/chat/completions")

    return app


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--producer", required=True, help="the kv_producer vLLM server's URL")
    parser.add_argument("--consumer", required=True, help="the kv_consumer vLLM server's URL")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8100)
    args = parser.parse_args(argv)
    import uvicorn

    uvicorn.run(create_app(args.producer, args.consumer), host=args.host, port=args.port)


if __name__ == "__main__":
    main()
