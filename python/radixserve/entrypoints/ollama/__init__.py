"""Ollama's API (/api/...), translated onto the chat, generate and embedding paths
(docs/http_api.md, docs/clients.md)."""
