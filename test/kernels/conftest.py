"""The kernel tests run Triton (its interpreter on the CPU); without triton installed there is nothing to test,
and the run says so instead of skipping the folder silently."""

from __future__ import annotations

import importlib.util

import pytest

if importlib.util.find_spec("triton") is None:
    collect_ignore_glob = ["test_*.py", "*/test_*.py"]

    def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
        terminalreporter.write_line("SKIPPED test/kernels/: triton is not installed (pip install triton)", yellow=True)
