"""One srt server as a child process of a benchmark: started with an environment, awaited, stopped cleanly."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import httpx

# What srt's Gemma 4 model logs when it is built: "YOCO fast prefill: on (...)", ": off (...)" or ": n/a (...)".
YOCO_LOG = re.compile(r"YOCO fast prefill: (on|off|n/a)")


@dataclass
class ServerProcess:
    proc: subprocess.Popen
    url: str
    log: Path
    startup_s: float

    def logged_yoco(self) -> str | None:
        """What the model said about YOCO when it was built ("on", "off", "n/a"), None if it said nothing."""
        found = YOCO_LOG.search(self.log.read_text(errors="replace"))
        return found.group(1) if found else None

    def stop(self, timeout_s: float = 60.0) -> int:
        """SIGTERM (what Ctrl-C does: the server stops its children), SIGKILL if it is still up after timeout_s."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        return self.proc.returncode


def answers(url: str) -> bool:
    """Whether something answers /health at `url` with 200."""
    try:
        return httpx.get(f"{url}/health", timeout=2).status_code == 200
    except httpx.HTTPError:
        return False


def log_tail(log: Path, lines: int = 30) -> str:
    return "\n".join(log.read_text(errors="replace").splitlines()[-lines:])


def start_server(server_args: list[str], port: int, env: dict[str, str], log: Path, timeout_s: float) -> ServerProcess:
    """`python -m srt.launch_server SERVER_ARGS --port PORT` with `env` added to this process's environment;
    returns once /health answers 200. RuntimeError with the log's tail if it exits or does not get ready."""
    url = f"http://127.0.0.1:{port}"
    if answers(url):  # we would benchmark someone else's server
        raise RuntimeError(f"a server already answers on port {port}: stop it or pass another --port")
    command = [sys.executable, "-m", "srt.launch_server", *server_args, "--port", str(port)]
    start = time.monotonic()
    with open(log, "w") as out:
        proc = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT, env={**os.environ, **env})
    server = ServerProcess(proc, url, log, 0.0)
    try:
        while time.monotonic() - start < timeout_s:
            if proc.poll() is not None:
                raise RuntimeError(f"the server exited with {proc.returncode}; {log}:\n{log_tail(log)}")
            if answers(url):
                server.startup_s = time.monotonic() - start
                return server
            time.sleep(0.5)
        raise RuntimeError(f"the server was not ready in {timeout_s:.0f} s; {log}:\n{log_tail(log)}")
    except BaseException:  # not ready, or interrupted while waiting: nobody else knows this process
        server.stop(timeout_s=10)
        raise
