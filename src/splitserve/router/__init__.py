"""The router: an OpenAI-compatible front door that picks a worker per request. Never imports torch."""
