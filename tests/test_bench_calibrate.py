"""``kvstrata bench calibrate``: the scaling, the simulator units, the report; one tiny live run."""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
from pathlib import Path

import pytest

from kvstrata.bench import fresh_profile
from kvstrata.bench.calibrate import (
    Scaling,
    compare,
    percentiles,
    placement_order,
    prompt_ids,
    scale_trace,
    sim_profile,
    sim_requests,
)
from kvstrata.bench.calibrate_live import LiveResult, probe_lengths
from kvstrata.cli import bench_calibrate
from kvstrata.cli.machine import cpu_model
from kvstrata.cli.main import main
from kvstrata.cli.output import RECORD_ENV
from kvstrata.costs import PrefillModel
from kvstrata.errors import InvalidInput
from kvstrata.sim.cluster import SimConfig, simulate
from kvstrata.sim.profiles import REFERENCE_CPU, reference_cpu, reference_for
from kvstrata.workloads.mooncake import TraceRequest

TRACE = Path(__file__).resolve().parents[2] / "shared" / "data" / "mooncake"
TRACE_FILE = TRACE / "conversation_trace.jsonl"
MODEL = PrefillModel(overhead_s=0.1, per_token_s=1e-3, per_token_ctx_s=1e-7)


def _req(t_ms: int, tokens: int, out: int, ids: tuple[int, ...]) -> TraceRequest:
    return TraceRequest(t_ms, tokens, out, ids)


def _trace() -> list[TraceRequest]:
    return [
        _req(0, 1500, 320, (1, 2, 3)),
        _req(2000, 2048, 3, (1, 2, 3, 4)),  # shares 3 blocks with the first
        _req(1000, 100_000, 5000, tuple(range(100, 296))),  # cut at max_prompt_tokens
    ]


def test_scaling_tokens_outputs_and_order() -> None:
    scaling = Scaling(block_tokens=16, max_prompt_tokens=1024, max_output_tokens=8)
    requests, record = scale_trace(_trace(), scaling, MODEL)
    assert [r.arrival_s for r in requests] == sorted(r.arrival_s for r in requests)
    first, long, second = requests
    assert first.prompt_tokens == round(1500 / 32) and first.output_tokens == 8  # 10 → cap 8
    assert second.prompt_tokens == 64 and second.output_tokens == 1  # 3/32 → at least 1
    assert long.prompt_tokens == 1024 and long.block_ids == tuple(range(100, 164))
    assert second.block_ids == (1, 2, 3, 4)
    assert record["token_scale"] == 16 / 512 and record["requests"] == 3


def test_rate_scale_fills_workers_at_the_target() -> None:
    scaling = Scaling(target_utilisation=0.6, workers=2, max_prompt_tokens=4096)
    requests, record = scale_trace(_trace(), scaling, MODEL)
    first, long, second = requests
    # the work: first and long fresh; second hits first's 2 full live blocks (47 tokens → 2)
    work = (
        MODEL.seconds(first.prompt_tokens)
        + MODEL.seconds(long.prompt_tokens)
        + MODEL.seconds(second.prompt_tokens - 32, 32)
    )
    assert record["offered_prefill_work_s"] == pytest.approx(work)
    span = requests[-1].arrival_s - requests[0].arrival_s
    assert work / (2 * span) == pytest.approx(0.6)
    assert record["rate_scale"] == pytest.approx(2.0 / span)


def test_scaling_rejects_bad_input() -> None:
    with pytest.raises(InvalidInput):
        Scaling(block_tokens=24)
    with pytest.raises(InvalidInput):
        scale_trace([_req(0, 100, 1, (1,)), _req(0, 100, 1, (2,))], Scaling(), MODEL)


def test_prompt_ids_share_exactly_the_shared_blocks() -> None:
    requests, _ = scale_trace(_trace(), Scaling(block_tokens=16), MODEL)
    a, _, b = requests
    ta, tb = prompt_ids(a, 16), prompt_ids(b, 16)
    assert len(ta) == a.prompt_tokens and len(tb) == b.prompt_tokens
    assert ta[:47] == tb[:47]  # a has 47 tokens: blocks 1, 2 and 15 tokens of block 3
    assert prompt_ids(b, 16) == tb  # deterministic
    other = scale_trace([_req(0, 512, 1, (9,)), _req(1, 512, 1, (1,))], Scaling(), MODEL)[0]
    assert prompt_ids(other[1], 16) == ta[:16] and prompt_ids(other[0], 16) != ta[:16]


def test_sim_profile_keeps_every_duration() -> None:
    base = reference_cpu()
    for block_tokens in (16, 32):
        k = 512 // block_tokens
        scaled = sim_profile(base, block_tokens, device_blocks=100)
        for new, cached in ((1, 0), (300, 0), (200, 1000)):
            assert scaled.cost.prefill.seconds(new * k, cached * k) == pytest.approx(
                base.cost.prefill.seconds(new, cached)
            )
        assert scaled.block_bytes == base.kv_bytes_per_token * block_tokens
        assert scaled.cost.prefill_chunk_tokens == 512 * k
        assert (scaled.device_blocks, scaled.host_blocks) == (100, 0)
    measured = sim_profile(base, 16, 100, prefill=MODEL)
    assert measured.cost.prefill.seconds(32 * 10) == pytest.approx(MODEL.seconds(10))


def test_an_isolated_simulated_request_takes_its_live_prefill_time() -> None:
    requests, _ = scale_trace(
        [_req(0, 4096, 32, tuple(range(8))), _req(600_000, 4096, 32, tuple(range(8)))],
        Scaling(block_tokens=16),
        MODEL,
    )
    profile = sim_profile(reference_cpu(), 16, device_blocks=64, prefill=MODEL)
    config = SimConfig(profile=profile, workers=1, service_noise=0.0)  # deterministic
    run = simulate(sim_requests(requests, 16), "round-robin", config)
    assert run.ttft_s[0] == pytest.approx(MODEL.seconds(128))  # fresh, nothing running
    # a full hit: the simulator always computes its last *simulated* token (1/32 of a live
    # one), the engine its last live token: they differ by less than one live token's cost
    one_token = MODEL.seconds(1, 127) - MODEL.overhead_s
    assert run.ttft_s[1] == pytest.approx(MODEL.seconds(1, 127), abs=one_token)
    assert run.ttft_s[1] < MODEL.seconds(2, 126)


def test_percentiles_and_compare() -> None:
    stats = percentiles([float(x) for x in range(1, 102)])
    assert (stats["p10"], stats["p50"], stats["p90"], stats["mean"]) == (11.0, 51.0, 91.0, 51.0)
    assert percentiles([])["p50"] is None
    live = [float(x) for x in range(1, 11)]
    out = compare(live, {"near": [x * 1.2 for x in live], "far": [x * 1.3 for x in live]})
    assert out["sim"]["near"]["ratio_p50"] == pytest.approx(1.2)
    assert out["sim"]["near"]["goal_met"] is True
    assert out["sim"]["far"]["goal_met"] is False
    assert compare([], {"x": [1.0]})["sim"]["x"]["goal_met"] is False


def _args(**overrides: object) -> argparse.Namespace:
    values: dict[str, object] = {
        "policy": "kvstrata",
        "workers": 2,
        "pool_gib": 1.0,
        "block_tokens": 16,
        "trace": TRACE_FILE,
        "start_s": 600.0,
        "limit": 3,
        "repeats": 2,
        "utilisation": 0.5,
        "pin_cpus": True,
        "omp_threads": 1,
        "json": True,
        "per_request": False,
    }
    return argparse.Namespace(**(values | overrides))


def _row(
    index: int, worker: str, tokens: int, ttft: float | None, predicted: float | None
) -> dict[str, object]:
    return {
        "index": index,
        "arrival_s": float(index),
        "worker": worker,
        "prompt_tokens": tokens,
        "cached_tokens": 0,
        "ttft_s": ttft,
        "predicted_ttft_s": predicted,
        "placed_at": 100.0 + index,
        "first_token_at": None if ttft is None else 100.0 + index + ttft,
    }


def _live(factor: float) -> LiveResult:
    return LiveResult(
        failures=[],
        workers={"w0": 2, "w1": 1},
        cached_tokens=10,
        prompt_tokens=100,
        probes=[(32, 0, 0.2), (1, 31, 0.1), (256, 0, 0.5)],
        fleet_ready_s=1.0,
        replay_wall_s=2.0,
        per_request=[
            _row(0, "w0", 40, factor * 1.0, 0.5),
            _row(1, "w1", 20, factor * 2.0, 2.0),
            _row(2, "w0", 40, factor * 3.0, 1.0),
            _row(3, "w1", 20, None, 1.0),  # failed: no TTFT, left out of the prediction
        ],
        router=[{"worker_id": "w0", "prefill_samples": 3}],
        decisions={"w0/lowest_ttft_plus_work": 2, "w1/lowest_ttft_plus_work": 1},
    )


def test_report_shape_medians_and_spread() -> None:
    sims = {"reference-cpu": [1.1, 2.2, 3.3], "measured": [2.0, 4.0, 6.0]}
    hits = {"reference-cpu": 0.1, "measured": 0.1}
    models = {"reference-cpu": MODEL, "measured": MODEL}
    data = bench_calibrate._report(
        [_live(1.0), _live(1.2)], sims, hits, _args(), {"rate_scale": 1.0}, 1456, models
    )
    assert data["live"]["ttft_s"]["p50"] == pytest.approx(2.2)  # median of 2.0 and 2.4
    assert data["ratio_p50"] == pytest.approx(1.0) and data["goal_met"] is True
    assert data["sim"]["measured"]["goal_met"] is False
    spread = data["sim"]["reference-cpu"]["ratio_spread"]["p50"]
    assert spread["min"] == pytest.approx(2.2 / 2.4) and spread["max"] == pytest.approx(1.1)
    assert len(data["live_runs"]) == 2 and len(data["probes"]) == 6
    assert set(data["prefill_models"]) == {"reference-cpu", "measured"}
    split = data["live_runs"][1]["per_worker"]
    assert split["w0"] == {
        "requests": 2,
        "prompt_tokens": 80,
        "ttft_p50_s": pytest.approx(2.4),  # 1.2 and 3.6
        "ttft_p90_s": pytest.approx(3.36),
    }
    assert split["w1"]["requests"] == 1 and split["w1"]["ttft_p50_s"] == pytest.approx(2.4)
    assert data["live_runs"][0]["router"] == [{"worker_id": "w0", "prefill_samples": 3}]
    prediction = data["live_runs"][0]["prediction"]  # measured ÷ predicted: 2, 1, 3
    assert prediction["n"] == 3 and prediction["within_2x"] == pytest.approx(2 / 3)
    assert prediction["actual_over_predicted"]["p50"] == pytest.approx(2.0)
    assert prediction["actual_over_predicted"]["p10"] == pytest.approx(1.2)
    assert data["live_runs"][0]["placement_order"] == {"pairs": 1, "inverted": 0}
    assert "requests" not in data["live_runs"][0]
    listed = bench_calibrate._report(
        [_live(1.0)], sims, hits, _args(per_request=True), {"rate_scale": 1.0}, 1456, models
    )
    assert [row["index"] for row in listed["live_runs"][0]["requests"]] == [0, 1, 2, 3]
    json.dumps(data, allow_nan=False)


def test_a_busy_machine_is_said_in_the_title() -> None:
    runs = [
        {"foreign_load": {"foreign_share": 0.12, "steal_share": 0.0}},
        {"foreign_load": {"foreign_share": 0.01, "steal_share": 0.06}},  # a noisy neighbour
        {"foreign_load": {"foreign_share": None}},  # not measured (no /proc)
    ]
    assert [bench_calibrate._taken(run) for run in runs] == [0.12, pytest.approx(0.07), None]
    busy = {"machine_to_itself": False, "live_runs": runs}
    assert bench_calibrate._busy_note(busy) == (
        "; NOT the machine to itself: others (processes, steal) took 12 %, 7 %, ? per live run"
    )
    assert bench_calibrate._busy_note({"machine_to_itself": True, "live_runs": runs}) == ""
    assert bench_calibrate._busy_note({"live_runs": []}) == ""  # an older bundle
    fresh = {"before": runs[1], "after": {"error": "…"}}  # a busy "before", a failed "after"
    assert bench_calibrate._busy_note(busy | {"fresh_profile": fresh}).endswith(
        "per live run, 7 % of the fresh timings (before, after)"
    )


def test_the_headline_is_the_profile_of_this_cpu() -> None:
    """On an EPYC the goal and the top-level ratios are ``reference-cpu-epyc``'s, with the
    Xeon's ``reference-cpu`` simulated beside it."""
    sims = {
        "reference-cpu-epyc": [1.0, 2.0, 3.0],
        "reference-cpu": [0.5, 1.0, 1.5],
        "measured": [1.1, 2.2, 3.3],
    }
    hits = dict.fromkeys(sims, 0.1)
    models = dict.fromkeys(sims, MODEL)
    data = bench_calibrate._report(
        [_live(1.0)], sims, hits, _args(), {"rate_scale": 1.0}, 1456, models,
        "reference-cpu-epyc",
    )  # fmt: skip
    assert data["goal"].endswith("(reference-cpu-epyc)")
    epyc = data["sim"]["reference-cpu-epyc"]
    assert (data["ratio_p50"], data["ratio_p90"]) == (epyc["ratio_p50"], epyc["ratio_p90"])
    assert data["goal_met"] is epyc["goal_met"] is True
    assert data["sim"]["reference-cpu"]["goal_met"] is False  # reported, not the headline
    assert set(data["prefill_models"]) == set(sims) and set(REFERENCE_CPU.values()) <= set(sims)


def test_the_fresh_profile_is_measured_by_the_pinned_profiles_command() -> None:
    """A real ``kvstrata bench prefill`` subprocess (the tiny model), pinned where taskset is."""
    data = fresh_profile.measure("16,32,64", 1, model="tiny")
    assert [(s["new_tokens"], s["cached_tokens"]) for s in data["samples"]] == [
        (16, 0), (32, 0), (64, 0)
    ]  # fmt: skip
    assert data["pinned"] is (shutil.which("taskset") is not None)
    assert fresh_profile.pinned_cpu() in os.sched_getaffinity(0)
    assert data["foreign_load"]["wall_s"] > 0  # whether anything else ran meanwhile
    assert data["command"].startswith("OMP_NUM_THREADS=1 ")
    assert "bench prefill --model tiny --points 16,32,64 --repeat 1 --stat min" in data["command"]
    model = fresh_profile.model_of(data, "fresh")
    assert model.name == "fresh" and model.seconds(64, 0) > 0
    slower = {**data, "samples": [{**s, "seconds": 2 * s["seconds"]} for s in data["samples"]]}
    assert fresh_profile.drift(data, slower) == {"16": 2.0, "32": 2.0, "64": 2.0}
    with pytest.raises(InvalidInput, match=r"fresh profile: .* exited 2"):
        fresh_profile.measure("16,x", 1, model="tiny")


def test_the_fresh_profile_keeps_out_of_the_callers_record_and_times_out_cleanly(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    record = tmp_path / "record.json"
    monkeypatch.setenv(RECORD_ENV, str(record))
    fresh_profile.measure("16,32,64", 1, model="tiny", hide=(RECORD_ENV,))
    assert not record.exists()  # the child's table did not land in the caller's record
    monkeypatch.setattr(fresh_profile, "_TIMEOUT_S", 0.2)  # less than a Python start-up
    with pytest.raises(InvalidInput, match="timed out"):
        fresh_profile.measure("16,32,64", 1, model="tiny")


def test_a_failed_measurement_after_the_fleets_is_recorded_not_raised() -> None:
    def fails() -> dict[str, str]:
        raise InvalidInput("fresh profile: `x` exited 1: boom")

    assert bench_calibrate._after(fails) == {"error": "fresh profile: `x` exited 1: boom"}
    assert bench_calibrate._after(lambda: {"samples": []}) == {"samples": []}


def test_the_title_gives_the_fresh_profiles_ratios() -> None:
    fresh = {"ratio_p50": 0.96, "ratio_p90": 0.91, "goal_met": True}
    moved = {"16": 1.2, "1024": 0.99, "2032+16": 1.01, "512+256": 1.1}
    record = {"before": {"pinned": True}, "after_vs_before": moved}
    data = {"sim": {"fresh": fresh}, "fresh_profile": record}
    assert bench_calibrate._fresh_note(data) == (
        "; fresh (timings measured just before): 0.960 / 0.910, goal met,"
        " 2032+16 tokens after ÷ before 1.010"  # the longest point
    )
    unpinned = {"before": {"pinned": False}, "after_vs_before": None}  # "after" failed
    assert bench_calibrate._fresh_note({"sim": {"fresh": fresh}, "fresh_profile": unpinned}) == (
        "; fresh (UNPINNED timings measured just before): 0.960 / 0.910, goal met"
    )
    assert bench_calibrate._fresh_note({"sim": {}}) == ""  # --no-fresh-profile


def test_placement_order_counts_first_tokens_against_placements() -> None:
    rows = [
        ("w0", 1.00, 5.0),
        ("w0", 1.01, 3.0),  # placed after the first, its first token 2 s before: inverted
        ("w0", 1.02, 5.03),  # within the tolerance of the first's: one step's
        ("w1", 1.00, 9.0),  # another worker: no pair with w0's
        ("w1", 2.00, 9.5),
    ]
    assert placement_order(rows) == {"pairs": 4, "inverted": 1}
    assert placement_order([]) == {"pairs": 0, "inverted": 0}


def test_cpu_model_reads_cpuinfo(tmp_path: Path) -> None:
    info = tmp_path / "cpuinfo"
    info.write_text("processor\t: 0\nvendor_id\t: AuthenticAMD\nmodel name\t: AMD EPYC 7B13\n")
    assert cpu_model(info) == "AMD EPYC 7B13"
    assert cpu_model(tmp_path / "missing") != ""  # the platform's name, or "unknown"


def test_cpu_detail_tells_apart_two_cpus_of_one_name(tmp_path: Path) -> None:
    from kvstrata.cli.machine import cpu_detail

    def info(family: int, flags: str) -> Path:
        path = tmp_path / f"cpuinfo-{family}"
        block = f"processor\t: 0\nmodel name\t: AMD EPYC\ncpu family\t: {family}\nmodel\t: 2\n"
        second = "processor\t: 1\nflags\t: amx_bf16\n"  # only the first CPU's block is read
        path.write_text(f"{block}flags\t: fpu {flags}\n\n{second}")
        return path

    assert cpu_detail(info(26, "avx2 avx512f avx512_bf16")) == "family 26 model 2, avx512_bf16"
    assert cpu_detail(info(25, "avx2")) == "family 25 model 2, avx2"
    assert cpu_detail(tmp_path / "missing") is None


def test_device_blocks_from_the_pool() -> None:
    assert bench_calibrate.device_blocks(1.0, 16) == (1 << 30) // (16 * 46_080)
    assert math.isclose(bench_calibrate.device_blocks(2.0, 32), (2 << 30) // (32 * 46_080))


@pytest.mark.slow
def test_tiny_live_replay_json_shape(capsys: pytest.CaptureFixture[str]) -> None:
    if not TRACE_FILE.is_file():
        pytest.skip(f"{TRACE_FILE} missing")
    argv = ["bench", "calibrate", "--trace", str(TRACE_FILE), "--limit", "8"]
    argv += ["--max-prompt-tokens", "512", "--probe-rounds", "0", "--per-request", "--json"]
    assert main([*argv, "--fresh-points", "16,64,128"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["live"]["ttft_s"]["n"] + data["failures"] == 8
    for key in ("p10", "p50", "p90", "p99", "mean"):
        assert data["live"]["ttft_s"][key] > 0 and data["sim"]["reference-cpu"]["ttft_s"][key] > 0
    assert isinstance(data["goal_met"], bool) and data["ratio_p50"] > 0
    assert data["scaling"]["requests"] == 8 and data["scaling"]["block_tokens"] == 16
    assert "measured" not in data["sim"]  # no probes, no fit
    fresh = data["fresh_profile"]  # the engine alone, measured before and after the fleets
    assert [len(fresh[when]["samples"]) for when in ("before", "after")] == [3, 3]
    assert set(fresh["after_vs_before"]) == {"16", "64", "128"}
    assert data["sim"]["fresh"]["ttft_s"]["p50"] > 0
    model = fresh_profile.model_of(fresh["before"], "")  # simulated from the "before" fit
    k = 512 // 16  # simulator tokens per live token (sim_profile)
    assert data["prefill_models"]["fresh"]["per_token_s"] * k == pytest.approx(model.per_token_s)
    headline = data["reference_profile"]  # the profile of the CPU this runs on
    assert headline["cpu"] == cpu_model()
    assert (headline["name"], headline["cpu_family"]) == reference_for(cpu_model())
    assert data["ratio_p50"] == data["sim"][headline["name"]]["ratio_p50"]
    assert set(REFERENCE_CPU.values()) <= set(data["sim"])  # every CPU's, side by side
    assert isinstance(data["machine_to_itself"], bool)  # what else ran meanwhile
    assert data["live_runs"][0]["foreign_load"]["wall_s"] > 0
    used = data["live_runs"][0]["replay_cpu"]["processes"]  # who used the CPUs in the replay
    assert {"up", "this process"} <= set(used) and {"serve w0", "serve w1"} & set(used)
    assert sum(p["cpu_s"] for label, p in used.items() if label.startswith("serve")) > 0
    assert data["pin_cpus"] is True  # each worker owns a core, as reference-cpu assumes
    live_split = data["live_runs"][0]["per_worker"]
    assert sum(side["requests"] for side in live_split.values()) == data["live"]["ttft_s"]["n"]
    assert set(live_split) <= set(data["live_runs"][0]["served_by"])
    sim_split = data["sim"]["reference-cpu"]["per_worker"]
    assert sum(side["requests"] for side in sim_split.values()) == 8
    for split in (live_split, sim_split):
        assert all(side["prompt_tokens"] > 0 for side in split.values())
    router = data["live_runs"][0]["router"]
    assert len(router) == 2 and all(w["prefill_model"]["per_token_s"] > 0 for w in router)
    # every replayed request and both warm-ups were routed (and counted by reason)
    assert sum(data["live_runs"][0]["decisions"].values()) >= 8 + 2
    rows = data["live_runs"][0]["requests"]  # the front door's prediction of every answer
    assert [row["index"] for row in rows] == list(range(8))
    answered = [row for row in rows if row["ttft_s"] is not None]
    assert answered and all(row["predicted_ttft_s"] > 0 for row in answered)
    assert data["live_runs"][0]["prediction"]["n"] == len(answered)
    assert all(row["placed_at"] <= row["first_token_at"] for row in answered)


def test_probe_lengths_cover_the_replayed_prompts() -> None:
    assert probe_lengths(4096) == (32, 256, 1024, 2048, 4096)
    assert probe_lengths(1500) == (32, 256, 1024)
    assert probe_lengths(40) == (32, 256)  # a fit needs two lengths at least
