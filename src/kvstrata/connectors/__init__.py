"""Connectors: kvstrata as the KV storage backend of other engines.

``vllm`` holds ``KvstrataConnector`` (a vLLM ``KVConnectorBase_V1``, loaded through
``kv_connector_module_path="kvstrata.connectors.vllm"``); it and ``vllm_stats`` (its
``KVConnectorStats`` and Prometheus counters) are the only modules here that import vLLM. The
parts it is made of are plain code that the main test suite checks without vLLM:
``vllm_layout`` (vLLM's per-layer KV tensors ↔ one kvstrata object per block),
``vllm_identity`` (fingerprint and tenant from vLLM's model config and ``cache_salt``),
``vllm_plan`` (the scheduler side's bookkeeping: which blocks to load and store each step),
``vllm_worker`` (the worker side: store, loads with digest check, saves, events, stats),
``vllm_loader`` (a step's loads: fetched on a thread, placed layer by layer, with a deadline),
``vllm_saver`` (the bounded background saver and its pinned-block bookkeeping) and
``vllm_lookup`` (how the scheduler asks the worker's store, in one process or across two).
"""
