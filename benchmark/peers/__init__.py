"""Peers for benchmark/compare_peers.py: llama.cpp's llama-server, an HF transformers baseline,
the server processes that run them, and the report (table + plots) written from their results."""
