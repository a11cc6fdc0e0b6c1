"""Anthropic's Messages API, translated onto the chat path (docs/http_api.md, docs/clients.md)."""
