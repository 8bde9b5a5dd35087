"""A server whose scheduler, a tensor-parallel rank or the detokenizer dies says so and, by default, exits
(issue #29, item 5).

With --exit-on-child-death (the default), the scheduler (or, with --tp-size 2, rank 1) killed: open streams
end with an error event and `[DONE]`, the server exits with status 1 within seconds, and no process or socket
file is left behind. With --no-exit-on-child-death, the detokenizer killed: the server stays up, /health
answers 503, every request a 503 error, /server_info a 503 at once, and the cut stream counts as an abort in
the metrics. Its main process then killed by SIGKILL leaves nothing behind either: the scheduler notices and
removes the socket files.

Each test starts its own server: the module-wide one of test_serving_openai.py must stay healthy.
"""

from __future__ import annotations

import json
import multiprocessing
import os
import signal
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest
from serving_fixtures import PRESET, Server, alive, child_pids, start_server

from srt.entrypoints.processes import ServingProcesses

EXIT_BOUND_S = 10  # "exits within seconds", with room for a loaded 2-core machine
HEALTH_BOUND_S = 5  # "/health 503 within a second": measured ~0.03 s; the bound leaves room for load
LONG_STREAM = {"text": "hello", "sampling_params": {"max_new_tokens": 400, "ignore_eos": True}, "stream": True}


def serving_child(server: Server, name: str) -> int:
    """The pid of the server's `srt-<name>` process (children name themselves in /proc/PID/comm)."""
    for pid in child_pids(server.proc.pid):
        try:
            if Path(f"/proc/{pid}/comm").read_text().strip() == f"srt-{name}":
                return pid
        except OSError:
            continue
    raise AssertionError(f"no srt-{name} process under the server")


def start_in_tmpdir(model: Path, tmp_path: Path, *extra: str) -> Server:
    """A server whose socket directory (tempfile's) lives under tmp_path/tmp, where the test can look."""
    (tmp_path / "tmp").mkdir()
    os.environ["TMPDIR"], saved = str(tmp_path / "tmp"), os.environ.get("TMPDIR")
    try:
        return start_server(model, tmp_path / "server.log", *extra)
    finally:
        os.environ.pop("TMPDIR") if saved is None else os.environ.update(TMPDIR=saved)


class StreamReader(threading.Thread):
    """Reads one /generate stream to its end in the background; `events` are its data lines."""

    def __init__(self, url: str) -> None:
        super().__init__(daemon=True)
        self.url, self.events, self.started = url, [], threading.Event()
        self.start()

    def run(self) -> None:
        with httpx.stream("POST", f"{self.url}/generate", json=LONG_STREAM, timeout=60) as response:
            for line in response.iter_lines():
                if line.startswith("data: "):
                    self.events.append(line.removeprefix("data: "))
                    self.started.set()


def assert_ends_with_error_event(events: list[str]) -> None:
    assert len(events) >= 3 and events[-1] == "[DONE]", events[-3:]
    error = json.loads(events[-2])["error"]
    assert error["type"] == "server_error" and "exited unexpectedly" in error["message"], error


def assert_nothing_left(children: list[int], tmp_path: Path) -> None:
    deadline = time.monotonic() + EXIT_BOUND_S
    while (any(alive(pid) for pid in children) or list((tmp_path / "tmp").glob("srt-ipc-*"))) and (
        time.monotonic() < deadline
    ):
        time.sleep(0.1)
    assert not [pid for pid in children if alive(pid)], "children outlived the server"
    assert not list((tmp_path / "tmp").glob("srt-ipc-*")), "socket files left behind"


@pytest.mark.parametrize(
    ("victim", "extra"), [("scheduler", ()), ("scheduler-1", ("--tp-size", "2"))], ids=["scheduler", "tp-rank-1"]
)
def test_a_dead_scheduler_ends_open_streams_with_an_error_and_the_server_exits_1(
    tiny_checkpoint, tmp_path, victim: str, extra: tuple[str, ...]
):
    """The scheduler, or under tensor parallelism a rank other than 0 (rank 0 then fails in its next collective)."""
    server = start_in_tmpdir(tiny_checkpoint(PRESET), tmp_path, *extra)
    children = sorted(child_pids(server.proc.pid))
    try:
        stream = StreamReader(server.url)
        assert stream.started.wait(30), "the stream never started"
        os.kill(serving_child(server, victim), signal.SIGKILL)
        killed = time.monotonic()
        while True:  # from the kill on, /health is never 200 again: 503 while it listens, then refused
            try:
                status = httpx.get(f"{server.url}/health", timeout=5).status_code
            except httpx.TransportError:
                break
            if status == 503 or time.monotonic() - killed > HEALTH_BOUND_S:
                break
        assert time.monotonic() - killed <= HEALTH_BOUND_S, f"/health still {status} {HEALTH_BOUND_S} s on"
        code = server.proc.wait(EXIT_BOUND_S)
        exited = time.monotonic() - killed
        stream.join(EXIT_BOUND_S)
    finally:
        server.stop()
    print(f"{victim} killed: the server exited with {code} after {exited:.2f} s")
    assert code == 1, server.log.read_text()[-2000:]
    assert_ends_with_error_event(stream.events)
    assert f"the {victim} process exited unexpectedly" in server.log.read_text()
    assert_nothing_left(children, tmp_path)


def test_without_exit_on_child_death_the_server_stays_up_answering_503_until_killed(tiny_checkpoint, tmp_path):
    """Then SIGKILL of the main process: the surviving child exits and removes the socket files."""
    model = tiny_checkpoint(PRESET)
    server = start_in_tmpdir(model, tmp_path, "--no-exit-on-child-death")
    children = sorted(child_pids(server.proc.pid))
    try:
        stream = StreamReader(server.url)
        assert stream.started.wait(30), "the stream never started"
        os.kill(serving_child(server, "detokenizer"), signal.SIGKILL)
        killed = time.monotonic()
        while (health := httpx.get(f"{server.url}/health", timeout=5)).status_code != 503:
            assert time.monotonic() - killed < HEALTH_BOUND_S, f"/health still 200 {HEALTH_BOUND_S} s on"
            time.sleep(0.02)
        print(f"/health 503 {time.monotonic() - killed:.3f} s after the kill")
        assert health.json()["status"] == "failed" and "detokenizer" in health.json()["message"]
        stream.join(EXIT_BOUND_S)
        assert_ends_with_error_event(stream.events)
        response = httpx.post(
            f"{server.url}/v1/completions", json={"model": str(model), "prompt": "Hello", "max_tokens": 2}, timeout=30
        )
        assert response.status_code == 503, response.text
        assert response.json()["error"]["type"] == "server_error"
        start = time.monotonic()
        info = httpx.get(f"{server.url}/server_info", timeout=30)
        assert info.status_code == 503 and info.json()["error"]["message"], info.text
        assert time.monotonic() - start < 2, "/server_info waited for a scheduler that is gone"
        assert httpx.get(f"{server.url}/health_generate", timeout=30).status_code == 503
        metrics = httpx.get(f"{server.url}/metrics", timeout=30).text
        assert 'srt_requests_total{model_name="' in metrics and 'reason="abort"} 1.0' in metrics, metrics
        assert server.proc.poll() is None, "the server exited although --no-exit-on-child-death"
        assert list((tmp_path / "tmp").glob("srt-ipc-*")), "the socket directory is not where the test looks"
        server.proc.kill()  # SIGKILL: the main process cannot clean up; the scheduler must
        server.proc.wait()
    finally:
        server.stop()
    assert_nothing_left(children, tmp_path)


def test_a_child_killed_by_a_signal_is_named_before_those_that_exited_after_it() -> None:
    """A killed rank breaks its peers' connections and they exit with an error a moment later: the message
    names the killed one as the cause, whatever the order the children were started in."""
    fork = multiprocessing.get_context("fork")  # the targets touch nothing of this process
    children = {
        "scheduler": fork.Process(target=sys.exit, args=(1,)),  # exits with an error, like a broken peer
        "tp-rank-1": fork.Process(target=time.sleep, args=(60,)),
        "detokenizer": fork.Process(target=time.sleep, args=(60,)),
    }
    for proc in children.values():
        proc.start()
    processes = ServingProcesses(port_args=None, children=children)
    try:
        children["scheduler"].join(30)
        assert processes.problem() == "the scheduler process exited unexpectedly (exit code 1)"
        os.kill(children["tp-rank-1"].pid, signal.SIGKILL)
        children["tp-rank-1"].join(30)
        assert processes.problem() == (
            "the tp-rank-1 process exited unexpectedly (exit code -9); also exited: scheduler (exit code 1)"
        )
    finally:
        for proc in children.values():
            proc.kill()
            proc.join()
