"""The kernel tests run Triton (its interpreter on the CPU); without triton installed there is nothing to test."""

from __future__ import annotations

import importlib.util

if importlib.util.find_spec("triton") is None:
    collect_ignore_glob = ["test_*.py", "*/test_*.py"]
