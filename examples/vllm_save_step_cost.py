"""Step-thread time of wait_for_save's work: synchronous save (before) vs select+submit (now)."""
import statistics, sys, tempfile, time
from pathlib import Path
import torch
from prometheus_client import CollectorRegistry
from kvstrata.connectors.vllm_layout import BlockCodec
from kvstrata.connectors.vllm_plan import BlockSave, RequestSave
from kvstrata.connectors.vllm_saver import BackgroundSaver
from kvstrata.connectors.vllm_settings import connector_audit, connector_config
from kvstrata.connectors.vllm_worker import ConnectorWorker
from kvstrata.runtime.store_factory import build_store

N, L = 40, 30
layers = {f"l{i}": torch.randn(N, 3, 32, 128).to(torch.bfloat16) for i in range(L)}
codec = BlockCodec(layers, N, 32)
def worker(tmp):
    s = connector_config({"host_gib": 0.5, "disk_dir": str(tmp / "d"), "disk_gib": 1, "durable": False})
    a = connector_audit(s).start()
    return ConnectorWorker(build_store(codec.block_bytes, s, CollectorRegistry(), audit=a), codec, model="m", audit=a)
def req(rep):
    blocks = tuple(BlockSave(i, bytes([rep, i]) * 16, None, i * 32, (rep,) * 32) for i in range(34))
    return RequestSave(f"r{rep}", "default", blocks)
sync, asyn = [], []
for rep in range(6):
    with tempfile.TemporaryDirectory() as t:
        w = worker(Path(t))
        t0 = time.perf_counter(); w.save([req(rep)]); sync.append(1000 * (time.perf_counter() - t0)); w.close()
    with tempfile.TemporaryDirectory() as t:
        w = worker(Path(t)); saver = BackgroundSaver(w.save_request, max_blocks=1024).start()
        t0 = time.perf_counter(); saver.submit(w.select_saves([req(rep)])); asyn.append(1000 * (time.perf_counter() - t0))
        saver.wait_idle(60); assert w.stats.blocks_saved == 34; saver.close(); w.close()
print(f"34 blocks x {codec.block_bytes} B, step-thread ms: sync median {statistics.median(sync):.1f} (min {min(sync):.1f}, max {max(sync):.1f}); async median {statistics.median(asyn):.2f} (min {min(asyn):.2f}, max {max(asyn):.2f})")
