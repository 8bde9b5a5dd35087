"""Weights: safetensors checkpoints (single file or sharded) with Hugging Face names, or dummy weights."""
