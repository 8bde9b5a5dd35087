"""Model configuration: checkpoint configs through transformers, built-in presets."""
