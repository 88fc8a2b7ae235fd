"""What every engine adapter needs, torch-free: the reference engine and the vLLM connector
are both thin adapters on this layer.

- ``config``: the one frozen ``WorkerConfig`` (TOML file + overrides; ``docs/configuration.md``);
- ``store_factory``: the tiered store a configuration describes;
- ``blocks``: what a device pool tells the runtime (block records, listener and view protocols);
- ``bridge``: block bytes ↔ the store (metas, write policies, break-even, verified loads);
- ``events``: the KV event emitter (pool listener + the store's change feed → ZMQ batches);
- ``wiring``: who hears the pool and the store, in what order (one function for every adapter);
- ``tokenization`` and ``model_files``: prompt → tokens and checkpoint digests, shared with the
  router's front door.
"""
