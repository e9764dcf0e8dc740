"""The worker's OpenAI-compatible HTTP server."""
