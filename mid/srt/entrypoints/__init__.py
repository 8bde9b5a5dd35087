"""User-facing entry points: the Engine, the HTTP server and its OpenAI-compatible API, the CLI."""
