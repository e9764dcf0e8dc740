"""Load generator and reports for any OpenAI-compatible endpoint. Never imports torch."""
