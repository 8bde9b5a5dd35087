"""`python -m srt.launch_server --model ...`: the same as the `launch_server` command."""

from __future__ import annotations

from srt.entrypoints.launch_server import main

if __name__ == "__main__":
    main()
