"""OpenAI's Responses API, translated onto the chat path, with a durable store (docs/http_api.md)."""
