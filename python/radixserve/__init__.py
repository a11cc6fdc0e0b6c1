"""radixserve: an LLM serving engine with a radix prefix cache, paged KV pools and an overlap scheduler."""

__version__ = "0.1.0"
