"""Helpers of the serving tests: a real server on loopback, process trees, and in-process references."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import httpx
import openai

from srt.managers.inprocess import run_to_completion
from srt.managers.io_struct import TokenizedGenerateReq
from srt.managers.scheduler import Scheduler
from srt.sampling.sampling_params import SamplingParams
from srt.server_args import ServerArgs

PRESET = "tiny-gemma-4-E4B-it"
CONTEXT_LENGTH = 512
# The same knobs for the server, the Engine and the in-process reference: outputs must match exactly.
MODEL_ARGS = {"device": "cpu", "dtype": "float32", "context_length": CONTEXT_LENGTH}
# Two busy cores: one torch thread per process is many times faster than two fighting over them.
CHILD_ENV = {"OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}
STARTUP_TIMEOUT_S = 120


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@dataclass
class Server:
    proc: subprocess.Popen
    url: str
    log: Path

    def stop(self) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        return self.proc.returncode


def start_server(model: Path, log: Path, *extra: str) -> Server:
    """`python -m srt.launch_server` on a free loopback port; returns once /health answers 200."""
    port = free_port()
    args = [sys.executable, "-m", "srt.launch_server", "--model", str(model), "--port", str(port)]
    for key, value in MODEL_ARGS.items():
        args += [f"--{key.replace('_', '-')}", str(value)]
    args += ["--log-level", "warning", *extra]
    with open(log, "w") as out:
        proc = subprocess.Popen(args, stdout=out, stderr=subprocess.STDOUT, env={**os.environ, **CHILD_ENV})
    server = Server(proc, f"http://127.0.0.1:{port}", log)
    deadline = time.monotonic() + STARTUP_TIMEOUT_S
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited with {proc.returncode}:\n{log.read_text()}")
        try:
            if httpx.get(f"{server.url}/health", timeout=1).status_code == 200:
                return server
        except httpx.HTTPError:
            pass
        time.sleep(0.25)
    server.stop()
    raise RuntimeError(f"server not ready in {STARTUP_TIMEOUT_S} s:\n{log.read_text()}")


def stop_and_check_no_child_left(server: Server) -> None:
    """SIGTERM stops `server` with a clean exit status, and none of its children outlives it."""
    children = child_pids(server.proc.pid)
    assert len(children) >= 2  # scheduler and detokenizer (and multiprocessing's resource tracker)
    code = server.stop()
    assert code in (0, 128 + 15), server.log.read_text()[-3000:]  # uvicorn re-raises the SIGTERM it handled
    deadline = time.monotonic() + 5  # orphans would live on; give exiting ones (resource tracker) a moment
    while any(alive(child) for child in children) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not [child for child in children if alive(child)], "children outlived the server"


def wait_idle(url: str, timeout: float = 60.0, headers: dict[str, str] | None = None) -> dict:
    """/server_info once nothing runs or waits and every pool's slots are free or cached (none leaked);
    `headers`: e.g. a server's --api-key."""
    deadline = time.monotonic() + timeout
    while True:
        info = httpx.get(f"{url}/server_info", headers=headers, timeout=30).json()
        idle = info["num_running_reqs"] == 0 and info["num_waiting_reqs"] == 0
        pools = info["pools"].values()
        if idle and all(p["in_use"] == 0 and p["free"] + p["cached"] == p["total"] for p in pools):
            return info
        assert time.monotonic() < deadline, f"not idle after {timeout} s: {info}"
        time.sleep(0.2)


def openai_client(server: Server) -> openai.OpenAI:
    """The real openai client against `server`: no retries, so a failure shows as it happened."""
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="none", max_retries=0, timeout=60)


def child_pids(pid: int) -> set[int]:
    """Every live descendant of `pid` (from /proc; zombies excluded)."""
    parents: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        fields = stat.rsplit(")", 1)[1].split()
        if fields[0] != "Z":
            parents.setdefault(int(fields[1]), []).append(int(entry.name))
    found, todo = set(), [pid]
    while todo:
        for child in parents.get(todo.pop(), []):
            found.add(child)
            todo.append(child)
    return found


def is_resource_tracker(pid: int) -> bool:
    """multiprocessing's resource tracker: one per process that ever spawned, living as long as that process."""
    try:
        return b"resource_tracker" in Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return False


def alive(pid: int) -> bool:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


def reference_scheduler(model: Path, **overrides: object) -> Scheduler:
    """An in-process scheduler on MODEL_ARGS (cpu, float32), `overrides` replacing any of them."""
    return Scheduler(ServerArgs(model_path=str(model), **{**MODEL_ARGS, **overrides}))


def greedy_reference(
    scheduler: Scheduler, prompts: list[list[int]], max_new_tokens: int, ignore_eos: bool = True
) -> list[list[int]]:
    """Greedy output ids of each prompt run alone in the calling process."""
    outputs = []
    for i, ids in enumerate(prompts):
        params = SamplingParams(temperature=0.0, max_new_tokens=max_new_tokens, ignore_eos=ignore_eos)
        result = run_to_completion(scheduler, [TokenizedGenerateReq(f"ref-{i}", ids, params)])
        outputs.append(result[f"ref-{i}"].output_ids)
    return outputs


def prompt_logprobs_reference(scheduler: Scheduler, ids: list[int], top: int) -> list:
    params = SamplingParams(temperature=0.0, max_new_tokens=0)
    req = TokenizedGenerateReq("ref-logprobs", ids, params, True, 0, top)
    return run_to_completion(scheduler, [req])["ref-logprobs"].input_logprobs
