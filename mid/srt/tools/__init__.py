"""Developer command-line tools, each run as `python -m srt.tools.<tool>` (e.g. make_checkpoint, memory_plan)."""
