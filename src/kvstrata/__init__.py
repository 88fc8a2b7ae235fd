"""kvstrata: the LLM KV cache as a tiered, distributed storage system with exact reuse."""

__version__ = "0.1.0"
