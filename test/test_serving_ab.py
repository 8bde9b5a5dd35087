"""`bench/serving_ab.py` as a user runs it: real servers on loopback (YOCO on, then off) for the `smoke`
workload on a tiny checkpoint, checked against what each server itself reported (its log, /server_info)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from serving_fixtures import CHILD_ENV, MODEL_ARGS, PRESET, alive, free_port

REPO = Path(__file__).resolve().parents[1]
SCRIPT = REPO / "bench" / "serving_ab.py"


def test_yoco_ab_runs_the_workload_on_two_servers_and_prints_ratios(tiny_checkpoint, tmp_path) -> None:
    out_dir, port = tmp_path / "ab", free_port()
    server_args = ["--model", str(tiny_checkpoint(PRESET))]
    for key, value in MODEL_ARGS.items():
        server_args += [f"--{key.replace('_', '-')}", str(value)]
    command = [sys.executable, str(SCRIPT), "--workload", "smoke", "--out-dir", str(out_dir), "--port", str(port)]
    command += ["--time-limit", "150", "--emit-timestamps", "--client-processes", "2", *server_args]
    done = subprocess.run(command, capture_output=True, text=True, timeout=180, env={**os.environ, **CHILD_ENV})
    assert done.returncode == 0, done.stderr[-3000:]

    report = json.loads((out_dir / "ab-smoke.json").read_text())
    assert report["complete"] and report["server_args"] == server_args
    settings = report["settings"]
    assert [(s["yoco"], s["yoco_logged"]) for s in settings] == [("on", "on"), ("off", "off")]
    for setting in settings:
        info = setting["server_info"]
        assert info["server_args"]["disable_radix_cache"] is True  # the workload's server flag was added
        # every run's warm-up request and prompts, 4 tokens each, as the server counted them
        assert info["generated_tokens_total"] == ((1 + 4) + (1 + 8)) * 4
        assert [(r["run"]["concurrency"], r["metrics"]["completed"]) for r in setting["runs"]] == [(2, 4), (4, 8)]
        for run in setting["runs"]:
            assert all(r["success"] and r["output_tokens"] == 4 and r["input_len"] == 32 for r in run["requests"])
        assert not alive(setting["pid"])  # the server was stopped, not left behind
        assert "YOCO fast prefill" in Path(setting["server_log"]).read_text()

    table = done.stdout[done.stdout.index("smoke: concurrency 2") :]
    assert "YOCO on" in table and "YOCO off" in table and "off / on" in table
    on, off = (settings[i]["runs"][0]["metrics"]["ttft_ms"]["mean"] for i in (0, 1))
    ttft_row = next(line for line in table.splitlines() if line.startswith("TTFT mean"))
    assert ttft_row.split() == ["TTFT", "mean", "(ms)", f"{on:.2f}", f"{off:.2f}", f"{off / on:.3f}"]
    # the bench flags reached the runs: emit times asked for, and the table reads their client stage
    lag = [settings[i]["runs"][0]["metrics"]["emit_lag_ms"]["client"]["p50"] for i in (0, 1)]
    lag_row = next(line for line in table.splitlines() if line.startswith("Client lag p50"))
    assert lag_row.split()[4:6] == [f"{lag[0]:.2f}", f"{lag[1]:.2f}"]
    assert (out_dir / "ab-smoke.png").read_bytes().startswith(b"\x89PNG")


def test_a_server_that_is_not_ready_in_time_is_stopped_and_reported(tiny_checkpoint, tmp_path) -> None:
    out_dir = tmp_path / "ab"
    command = [sys.executable, str(SCRIPT), "--workload", "smoke", "--out-dir", str(out_dir), "--port"]
    command += [str(free_port()), "--startup-timeout", "1", "--model", str(tiny_checkpoint(PRESET))]
    done = subprocess.run(command, capture_output=True, text=True, timeout=60, env={**os.environ, **CHILD_ENV})
    assert done.returncode == 1 and "not ready in 1 s" in done.stderr
    report = json.loads((out_dir / "ab-smoke.json").read_text())
    assert not report["complete"] and report["problem"].startswith("YOCO on: the server was not ready")
    assert [s["runs"] for s in report["settings"]] == [[]]  # YOCO off was not tried after the failure
