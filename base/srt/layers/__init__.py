"""Building blocks of the model: norms, rotary embeddings, attention backends, logits, sampling, MoE."""
