"""kvstrata.serve: the reference engine behind an OpenAI-compatible HTTP API.

- ``app``: ``create_app(engine, model_name=..., metrics=...)``, the FastAPI app and its routes.
- ``protocol``: request models, response bodies and OpenAI-shaped errors.
- ``streaming``: the single engine thread, incremental detokenisation and stop strings.
"""
