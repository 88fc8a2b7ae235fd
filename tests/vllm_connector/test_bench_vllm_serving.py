"""``kvstrata bench vllm-serving`` plumbing that needs no vLLM: workload sizes, the four modes'
server and client arguments, mode rotation, ratios and goals from raw figures, output compare,
the JSON summary and the table."""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path
from typing import Any

import pytest

from kvstrata.bench.vllm_serving import (
    BLOCK_SIZE,
    GIB,
    MODES,
    ServingSizes,
    client_argv,
    host_gib,
    kv_bytes_per_token,
    server_argv,
    transfer_config,
)
from kvstrata.bench.vllm_serving_report import (
    client_figures,
    compare_outputs,
    goals,
    parse_metrics,
    rotated,
    summarize,
    table_rows,
)
from kvstrata.cli import bench_vllm
from kvstrata.errors import InvalidInput

SMOLLM2 = {
    "num_hidden_layers": 30,
    "num_attention_heads": 9,
    "num_key_value_heads": 3,
    "head_dim": 64,
    "hidden_size": 576,
}
BLOCK_BYTES = 32 * 23_040


def test_smollm2_kv_bytes_per_token() -> None:
    assert kv_bytes_per_token(SMOLLM2) == 30 * 2 * 3 * 64 * 2 == 23_040
    no_head_dim = {k: v for k, v in SMOLLM2.items() if k != "head_dim"}
    assert kv_bytes_per_token(no_head_dim) == 23_040


@pytest.mark.parametrize(
    "sizes",
    [
        ServingSizes(),
        ServingSizes(
            prefix_len=64, suffix_len=16, output_len=4, small_cache_blocks=6, host_blocks=8
        ),
        ServingSizes(prefix_len=256, small_cache_blocks=16, host_blocks=32),
    ],
)
def test_fits_is_inside_the_host_budget_and_exceeds_is_three_times_it(sizes: ServingSizes) -> None:
    fits, exceeds = sizes.workload("fits"), sizes.workload("exceeds")
    assert fits.small_cache_tokens < fits.working_set_tokens <= fits.host_tokens
    # one more prefix would not fit any more: the workload uses the budget
    assert fits.working_set_tokens + sizes.tokens_per_prefix > fits.host_tokens
    assert abs(exceeds.working_set_tokens - 3 * exceeds.host_tokens) <= sizes.tokens_per_prefix / 2
    for w in (fits, exceeds):
        assert w.working_set_tokens == w.num_prefixes * w.prefix_len + w.num_requests * (
            w.suffix_len + w.output_len
        )
        assert (
            w.small_cache_tokens - BLOCK_SIZE >= w.max_model_len
            and w.max_model_len % BLOCK_SIZE == 0
        )
        assert w.requests_per_prefix >= 2  # each prefix recurs


def test_default_sizes_keep_a_default_run_short() -> None:
    s = ServingSizes()
    requests = sum(s.workload(n).num_requests for n in ("fits", "exceeds"))
    # 4 modes × 3 repeats of both workloads' arrivals stay under ~20 min of client time
    assert 4 * 3 * requests / s.request_rate < 20 * 60


def test_sizes_reject_what_cannot_measure_anything() -> None:
    with pytest.raises(InvalidInput):
        ServingSizes(prefix_len=2048, small_cache_blocks=8)  # one request does not fit
    with pytest.raises(InvalidInput):  # 160 tokens fit 5 blocks, but one is vLLM's null block
        ServingSizes(
            prefix_len=64, suffix_len=16, output_len=4, small_cache_blocks=5, host_blocks=8
        )
    with pytest.raises(InvalidInput):
        ServingSizes(host_blocks=2)  # no prefix fits in the host budget
    with pytest.raises(InvalidInput):
        ServingSizes(host_blocks=33)  # 'fits' would be no larger than the small cache
    with pytest.raises(InvalidInput):
        ServingSizes(request_rate=0)
    with pytest.raises(InvalidInput):
        ServingSizes().workload("huge")


def test_host_gib_makes_exactly_the_budgets_blocks() -> None:
    for blocks in (1, 7, 32, 96, 1000):
        capacity = int(host_gib(blocks, BLOCK_BYTES) * GIB)  # what the connector makes of it
        assert capacity // BLOCK_BYTES == blocks  # the host tier floors to whole blocks


def _flag(argv: list[str], name: str) -> str:
    return argv[argv.index(name) + 1]


def test_the_four_modes_differ_only_in_cache_size_and_connector(tmp_path: Path) -> None:
    w = ServingSizes().workload("fits")
    argvs = {}
    for mode in MODES:
        transfer = transfer_config(
            mode, tmp_path, host_blocks=w.host_blocks, block_bytes=BLOCK_BYTES, disk_gib=2
        )
        argvs[mode] = server_argv(
            w, mode, model="/m", port=1, bytes_per_token=23_040, transfer=transfer
        )
    blocks = {m: int(_flag(a, "--num-gpu-blocks-override")) for m, a in argvs.items()}
    assert blocks == {
        "plain_small": w.small_cache_blocks,
        "plain_equal_memory": w.small_cache_blocks + w.host_blocks,
        "example_connector": w.small_cache_blocks,
        "kvstrata": w.small_cache_blocks,
    }
    for mode, argv in argvs.items():
        assert _flag(argv, "--kv-cache-memory-bytes") == str(blocks[mode] * BLOCK_BYTES)
        assert "--enable-prefix-caching" in argv
    assert "--kv-transfer-config" not in argvs["plain_small"] + argvs["plain_equal_memory"]
    example = json.loads(_flag(argvs["example_connector"], "--kv-transfer-config"))
    assert example["kv_connector"] == "ExampleConnector" and example["kv_role"] == "kv_both"
    ours = json.loads(_flag(argvs["kvstrata"], "--kv-transfer-config"))
    assert ours["kv_connector"] == "KvstrataConnector" and ours["kv_role"] == "kv_both"
    extra = ours["kv_connector_extra_config"]
    # same filesystem: both stores live in the run's temp dir
    assert Path(example["kv_connector_extra_config"]["shared_storage_path"]).parent == tmp_path
    assert Path(extra["disk_dir"]).parent == tmp_path
    assert int(extra["host_gib"] * GIB) // BLOCK_BYTES == w.host_blocks
    strip = {"--num-gpu-blocks-override", "--kv-cache-memory-bytes", "--kv-transfer-config"}

    def rest(argv: list[str]) -> list[str]:
        return [a for i, a in enumerate(argv) if a not in strip and argv[i - 1] not in strip]

    assert len({tuple(rest(a)) for a in argvs.values()}) == 1  # otherwise identical flags


def test_the_capped_peer_is_equal_memory_at_the_small_caches_concurrency(tmp_path: Path) -> None:
    from kvstrata.bench.vllm_serving import ALL_MODES

    w = ServingSizes().workload("exceeds")
    assert "plain_equal_memory_capped" in ALL_MODES and "plain_equal_memory_capped" not in MODES
    assert w.small_cache_seqs == w.small_cache_tokens // w.max_model_len == 2
    args = {"model": "/m", "port": 1, "bytes_per_token": 23_040, "transfer": None}
    capped = server_argv(w, "plain_equal_memory_capped", **args)  # type: ignore[arg-type]
    equal = server_argv(w, "plain_equal_memory", **args)  # type: ignore[arg-type]
    assert capped == [*equal, "--max-num-seqs", "2"]  # the same memory, fewer sequences
    assert (
        transfer_config(
            "plain_equal_memory_capped", tmp_path, host_blocks=1, block_bytes=1, disk_gib=1
        )
        is None
    )
    assert "--max-num-seqs" not in server_argv(w, "kvstrata", **args)  # type: ignore[arg-type]


def test_concurrency_is_what_ran_while_the_server_had_work() -> None:
    from kvstrata.bench.vllm_serving_report import concurrency, queue_gauges

    text = (
        "# HELP vllm:num_requests_running x\n"
        'vllm:num_requests_running{engine="0",model_name="m"} 2.0\n'
        'vllm:num_requests_running{engine="1",model_name="m"} 1.0\n'
        'vllm:num_requests_waiting{engine="0",model_name="m"} 4.0\n'
        'vllm:num_requests_waiting_by_reason{engine="0",reason="x"} 9.0\n'
    )
    assert queue_gauges(text) == (3.0, 4.0)
    got = concurrency([(0.0, 0.0), (1.0, 0.0), (3.0, 2.0), (0.0, 1.0), (0.0, 0.0)])
    assert got == {
        "samples": 5, "busy_samples": 3, "running_mean": 4 / 3, "running_max": 3.0,
        "waiting_mean": 1.0,
    }  # fmt: skip
    assert concurrency([])["running_mean"] is None


def test_polling_samples_a_live_endpoint_and_skips_failures() -> None:
    import http.server
    import threading
    import time

    from kvstrata.bench import vllm_serving

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            body = b"vllm:num_requests_running 2.0\nvllm:num_requests_waiting 1.0\n"
            self.send_response(200)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args: object) -> None:
            return

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        url = f"http://127.0.0.1:{server.server_address[1]}/metrics"
        with vllm_serving.polling(url) as polled:
            deadline = time.monotonic() + 20
            while len(polled) < 2 and time.monotonic() < deadline:
                time.sleep(0.05)
        assert polled[:2] == [(2.0, 1.0), (2.0, 1.0)]
    finally:
        server.shutdown()
    with vllm_serving.polling("http://127.0.0.1:1/metrics") as nothing:
        time.sleep(3 * vllm_serving.POLL_S)
    assert nothing == []  # refused polls are skipped, never raised


def test_client_uses_the_datasets_own_order_and_keeps_outputs() -> None:
    w = ServingSizes().workload("exceeds")
    client = client_argv(w, model="/m", port=1234)
    assert _flag(client, "--dataset-name") == "prefix_repetition"
    assert _flag(client, "--num-prompts") == str(w.num_requests)
    assert _flag(client, "--prefix-repetition-num-prefixes") == str(w.num_prefixes)
    assert "--disable-shuffle" not in client  # vLLM's sampler shuffles with --seed
    assert "--save-detailed" in client and _flag(client, "--temperature") == "0"


def test_rotation_puts_every_mode_first_once() -> None:
    orders = [rotated(MODES, r) for r in range(4)]
    assert [o[0] for o in orders] == list(MODES)
    assert all(sorted(o) == sorted(MODES) for o in orders)
    assert rotated(MODES, 4) == list(MODES) and rotated([], 3) == []


def test_parse_metrics_sums_engines_and_splits_sources() -> None:
    text = "\n".join(
        [
            'vllm:prompt_tokens_total{engine="0",model_name="m"} 100.0',
            'vllm:prompt_tokens_total{engine="1",model_name="m"} 20.0',
            'vllm:prompt_tokens_by_source_total{engine="0",source="external_kv_transfer"} 64.0',
            'vllm:external_prefix_cache_hits_total{engine="0"} 64.0',
            "unrelated_metric 5",
        ]
    )
    got = parse_metrics(text)
    assert got["prompt_tokens"] == 120 and got["external_hit_tokens"] == 64
    assert got["prompt_tokens_external_kv_transfer"] == 64


def _run(workload: str, mode: str, rep: int, ttft: float, tpot: float, texts: list[str]) -> Any:
    result = {"median_ttft_ms": ttft, "p99_ttft_ms": 2 * ttft, "median_tpot_ms": tpot}
    result |= {"request_throughput": 0.5, "completed": len(texts)}
    prompts = ["p0", "p1", "p2"]  # a run may lose texts, never prompts
    return {"workload": workload, "mode": mode, "rep": rep, "order": 0} | {
        "figures": client_figures(result),
        "prompts": prompts,
        "texts": texts,
    }


TTFT = {"plain_small": 900.0, "plain_equal_memory": 330.0, "example_connector": 600.0}


def _runs(texts_of: dict[tuple[str, int], list[str]] | None = None) -> list[Any]:
    runs = []
    for rep in range(3):
        for w in ("fits", "exceeds"):
            for mode in rotated(MODES, rep):
                ttft = TTFT.get(mode, 300.0) * (1 + 0.1 * rep) * (2 if w == "exceeds" else 1)
                tpot = 40.0 if mode == "kvstrata" else 35.0 + rep
                texts = (texts_of or {}).get((mode, rep), ["a", "b", "c"])
                runs.append(_run(w, mode, rep, ttft, tpot, texts))
    return runs


def _summary(runs: list[Any]) -> dict[str, Any]:
    return summarize(
        {"fits": {}, "exceeds": {}}, runs, modes=list(MODES), repeats=3,
        bytes_per_token=23_040, block_bytes=BLOCK_BYTES, wall_s=1.0,
    )  # fmt: skip


def test_ratios_are_medians_of_the_raw_figures_and_goals_follow() -> None:
    data = _summary(_runs())
    json.dumps(data)  # --json prints it as one object
    assert set(data["ratios"]) == {"fits", "exceeds"}
    for w, ratios in data["ratios"].items():
        assert set(ratios) == {
            "p50_vs_plain_small", "p50_vs_equal_memory", "p50_vs_example_connector",
            "p50_vs_equal_memory_capped", "tpot_vs_plain_small",
        }  # fmt: skip
        assert ratios["p50_vs_equal_memory_capped"] is None  # a mode not run: no ratio

        def med(mode: str, figure: str, w: str = w) -> float:
            raw = [
                r["figures"][figure]
                for r in data["runs"]
                if (r["workload"], r["mode"]) == (w, mode)
            ]
            return statistics.median(raw)

        ours = med("kvstrata", "ttft_p50_ms")
        assert ratios["p50_vs_plain_small"] == pytest.approx(
            med("plain_small", "ttft_p50_ms") / ours
        )
        assert ratios["p50_vs_equal_memory"] == pytest.approx(1.1)
        assert ratios["p50_vs_example_connector"] == pytest.approx(2.0)
        assert ratios["tpot_vs_plain_small"] == pytest.approx(40.0 / 36.0)
        s = data["summary"][w]["kvstrata"]["ttft_p50_ms"]
        assert (s["min"], s["median"], s["max"]) == (min(s["values"]), ours, max(s["values"]))
    g = data["goals"]
    assert g["fits.p50_vs_plain_small"]["met"] is True  # 3.0 ≥ 3
    assert g["fits.p50_vs_equal_memory"]["met"] is True  # 1.1 ≥ 1/1.2
    assert g["exceeds.p50_vs_equal_memory"]["met"] is False  # 1.1 < 2: reported, not hidden
    assert g["fits.tpot_vs_plain_small"]["met"] is False  # 1.11 > 1.1
    assert g["outputs_equal"]["met"] is True and data["output_mismatches"] == 0
    assert data["order"][:4] == [[0, "fits", m] for m in MODES]
    rows = table_rows(data)
    assert len([r for r in rows if r[0] in ("fits", "exceeds") and r[1] in MODES]) == 8
    assert rows[0][2].count("[") == 1 and "–" in rows[0][2]  # median [min–max]


def test_a_missing_mode_gives_no_ratio_and_no_verdict() -> None:
    runs = [r for r in _runs() if r["mode"] in ("plain_small", "kvstrata")]
    data = summarize(
        {"fits": {}}, [r for r in runs if r["workload"] == "fits"],
        modes=["plain_small", "kvstrata"], repeats=3, bytes_per_token=1, block_bytes=32,
        wall_s=0.0,
    )  # fmt: skip
    assert data["ratios"]["fits"]["p50_vs_equal_memory"] is None
    assert data["goals"]["fits.p50_vs_equal_memory"]["met"] is None
    assert "exceeds.p50_vs_plain_small" not in data["goals"]


def test_output_mismatches_are_counted_per_mode() -> None:
    data = _summary(_runs({("kvstrata", 1): ["a", "X", "c"], ("example_connector", 2): ["a"]}))
    out = data["outputs"]
    assert data["outputs_equal"] is False and out["mismatches"] == data["output_mismatches"]
    # kvstrata rep 1 differs on one request of each workload; a run that lost texts counts whole
    assert out["mismatches_by_mode"]["kvstrata"] == 2
    assert out["mismatches_by_mode"]["example_connector"] == 2 * 3
    assert out["mismatches_by_mode"]["plain_small"] == 0
    example = {"workload": "fits", "mode": "kvstrata", "rep": 1, "request": 1, "text": "X"}
    assert (
        example | {"reference": "b", "reference_run": "plain_small rep 0"}
        in out["mismatch_examples"]
    )
    assert data["goals"]["outputs_equal"]["met"] is False


def test_outputs_compare_by_prompt_not_position() -> None:
    a = {
        "workload": "w",
        "mode": "plain_small",
        "rep": 0,
        "prompts": ["x", "y"],
        "texts": ["1", "2"],
    }
    b = {"workload": "w", "mode": "kvstrata", "rep": 0, "prompts": ["y", "x"], "texts": ["2", "1"]}
    assert compare_outputs([a, b])["outputs_equal"] is True
    assert compare_outputs([a])["outputs_equal"] is False  # nothing compared proves nothing
    assert goals({}, True)["outputs_equal"]["met"] is True


def test_cli_parses_the_serving_subcommand() -> None:
    parser = argparse.ArgumentParser()
    bench_vllm.register(parser.add_subparsers())
    args = parser.parse_args(
        ["vllm-serving", "--modes", "plain_small,kvstrata", "--repeats", "2", "--host-blocks",
         "64", "--request-rate", "0.25", "--json"]
    )  # fmt: skip
    assert args.func is bench_vllm.run_serving and args.json and args.repeats == 2
    sizes = bench_vllm.sizes_from_args(args)
    assert sizes.host_blocks == 64 and sizes.request_rate == 0.25
    assert sizes.prefix_len == ServingSizes().prefix_len
    bad = parser.parse_args(["vllm-serving", "--modes", "plain_small,turbo"])
    with pytest.raises(InvalidInput):
        bench_vllm.run_serving(bad)


def test_dtype_reaches_every_server_and_the_kv_budget() -> None:
    from kvstrata.bench.vllm_serving import DTYPE_BYTES, ServingSizes, server_argv

    workload = ServingSizes(dtype="float32").workload("fits")
    argv = server_argv(
        workload, "plain_small", model="/m", port=1, bytes_per_token=46080, transfer=None
    )
    assert argv[argv.index("--dtype") + 1] == "float32" and DTYPE_BYTES["float32"] == 4
    assert ServingSizes().workload("fits").dtype == "bfloat16"
