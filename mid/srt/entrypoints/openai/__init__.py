"""The OpenAI-compatible API: request models (protocol), completions and chat handlers."""
