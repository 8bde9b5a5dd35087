"""Developer tools: building tiny Gemma 4 checkpoints (`python -m srt.tools.make_checkpoint`)."""
