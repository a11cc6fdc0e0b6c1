"""OpenAI's Files and Batch APIs (docs/http_api.md, "Batch")."""
