"""Speculative decoding: frozen-KV MTP (the Gemma 4 assistant drafts, the target verifies)."""
