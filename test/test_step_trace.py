"""The scheduler's step trace (SRT_STEP_TRACE) records every request's arrival, first chunk and first token, and
bench/step_trace.py reads a request's time to first token back from it."""

from __future__ import annotations

import gzip
import importlib.util
import json
import os
import sys
from pathlib import Path

import pytest

from srt.envs import SRT_STEP_TRACE
from srt.managers.inprocess import run_to_completion
from srt.managers.io_struct import TokenizedGenerateReq
from srt.managers.scheduler import Scheduler
from srt.model_executor.model_runner import ModelRunner
from srt.sampling.sampling_params import SamplingParams
from srt.server_args import ServerArgs

READER = Path(__file__).resolve().parents[1] / "bench" / "step_trace.py"


def load_reader():
    if str(READER.parent) not in sys.path:
        sys.path.insert(0, str(READER.parent))  # the reader imports bench/serving_metrics.py
    spec = importlib.util.spec_from_file_location("step_trace_reader", READER)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_trace_records_each_request_from_arrival_to_first_token(tiny_checkpoint, tmp_path, monkeypatch) -> None:
    prefix = tmp_path / "trace"
    monkeypatch.setenv(SRT_STEP_TRACE, str(prefix))
    args = ServerArgs(model_path=str(tiny_checkpoint("tiny-gemma-4-E4B-it")), device="cpu", dtype="float32",
                      chunked_prefill_size=32)  # fmt: skip
    scheduler = Scheduler(args, ModelRunner(args))
    params = SamplingParams(temperature=0.0, max_new_tokens=4, ignore_eos=True)
    # the 70-token prompt takes three chunks of 32, its first token comes with the last one
    prompts = {"a": list(range(3, 73)), "b": list(range(5, 15))}
    requests = [TokenizedGenerateReq(rid=rid, input_ids=ids, sampling_params=params) for rid, ids in prompts.items()]
    run_to_completion(scheduler, requests)

    reader = load_reader()
    events = reader.load_events(str(prefix))
    assert Path(f"{prefix}.{os.getpid()}").exists()
    assert [e["rid"] for e in events if e["event"] == "arrive"] == ["a", "b"]
    admitted = [rid for e in events if e["event"] == "launch" for rid in e["admitted"]]
    assert sorted(admitted) == ["a", "b"]  # once each: the first chunk only
    firsts = [rid for e in events if e["event"] == "finish" for rid in e["first_token"]]
    assert sorted(firsts) == ["a", "b"]
    prompt_steps = [e for e in events if e["event"] == "launch" and e["prompt_tokens"]]
    assert sum(e["prompt_tokens"] for e in prompt_steps) == 70 + 10
    summary = reader.summarize(events)
    assert len(summary["queued"]) == len(summary["computed"]) == 2
    assert all(seconds >= 0 for seconds in summary["queued"] + summary["computed"])
    assert len(summary["prompt step"]) == len(prompt_steps)
    # the host's stretches after each prompt step end at the next forward call
    stretches = reader.gap_stretches(events)
    assert any(name.endswith("-> forward") for name in stretches)
    assert all(seconds >= 0 for values in stretches.values() for seconds in values)
    scheduler.check_integrity()


def test_a_prompt_step_launched_before_the_read_of_the_one_before_counts_from_that_read() -> None:
    """Under the overlap schedule step 2 is launched (t=1) before step 1 is read (t=10): step 2's time is from
    that read to its own (t=15), not from its launch; a step launched after the last read counts from its launch."""

    def launch(t: float, tokens: int) -> dict:
        return {"event": "launch", "t": t, "prompt_tokens": tokens, "admitted": []}

    def finish(t: float) -> dict:
        return {"event": "finish", "t": t, "first_token": []}

    events = [launch(0, 8), launch(1, 8), finish(10), finish(15), launch(20, 8), finish(26)]
    assert load_reader().summarize(events)["prompt step"] == [10, 5, 6]


def test_ttft_breakdown_matches_client_records_with_the_trace() -> None:
    """Two requests sent together: each client record is matched with the request whose first token the
    scheduler read last before the client's first token, and its TTFT splits into stretches that add up."""
    reader = load_reader()
    events = [
        {"t": 10.000, "event": "arrive", "rid": "warm"},  # before the timed sends: never matched
        {"t": 11.004, "event": "arrive", "rid": "a"},
        {"t": 11.006, "event": "arrive", "rid": "b"},
        {"t": 11.010, "event": "launch", "admitted": ["a"], "prompt_tokens": 8, "decode_rows": 0},
        {"t": 11.090, "event": "finish", "first_token": ["a"]},
        {"t": 11.095, "event": "launch", "admitted": ["b"], "prompt_tokens": 8, "decode_rows": 1},
        {"t": 11.180, "event": "finish", "first_token": ["b"]},
    ]
    stamps = {"scheduler": 11.091, "detokenizer": 11.092, "tokenizer_manager": 11.094, "sse": 11.095, "client": 11.096}
    records = [  # the later one first: matching goes by the client's first token, not by list order
        {"sent_at": 11.001, "ttft_s": 0.185, "first_emit_ts": {}},
        {"sent_at": 11.000, "ttft_s": 0.096, "first_emit_ts": stamps},
        {"sent_at": 11.002, "ttft_s": None},  # failed: no first token
    ]
    rows = reader.ttft_breakdown(events, records)
    assert len(rows) == 2
    first, second = rows  # in send order
    assert first["client -> scheduler"] == pytest.approx(0.004)  # a
    assert first["queued"] == pytest.approx(0.006) and first["computed"] == pytest.approx(0.080)
    assert first["  read -> emitted"] == pytest.approx(0.001) and first["  -> client"] == pytest.approx(0.001)
    assert second["client -> scheduler"] == pytest.approx(0.005)  # b
    assert second["queued"] == pytest.approx(0.089) and second["computed"] == pytest.approx(0.085)
    for row in rows:
        parts = ("client -> scheduler", "queued", "computed", "scheduler -> client")
        assert sum(row[name] for name in parts) == pytest.approx(row["ttft"])


def test_gzipped_traces_and_runs_read_as_plain_ones(tmp_path) -> None:
    """The traces and runs kept in bench/results are gzipped; the reader opens them as they are."""
    reader = load_reader()
    events = [{"t": 2.0, "event": "arrive", "rid": "b"}, {"t": 1.0, "event": "arrive", "rid": "a"}]
    with gzip.open(tmp_path / "trace.jsonl.gz", "wt") as out:
        out.write("\n".join(json.dumps(e) for e in events) + "\n")
    assert [e["rid"] for e in reader.load_events(str(tmp_path / "trace"))] == ["a", "b"]
    with gzip.open(tmp_path / "run.json.gz", "wt") as out:
        json.dump({"requests": [{"sent_at": 2.0, "ttft_s": 0.1}, {"sent_at": 1.0, "ttft_s": 0.1}, {"ttft_s": 1}]}, out)
    assert [r["sent_at"] for r in reader.request_records(tmp_path / "run.json.gz")] == [1.0, 2.0]


def test_a_request_listed_as_first_token_twice_is_timed_once() -> None:
    """Under the overlap schedule a one-token request runs in the step after its first too, whose read lists it
    again: its wait counts once, from the first read."""
    events = [
        {"t": 0.0, "event": "arrive", "rid": "a"},
        {"t": 1.0, "event": "launch", "admitted": ["a"], "prompt_tokens": 8, "decode_rows": 0},
        {"t": 1.5, "event": "launch", "admitted": [], "prompt_tokens": 0, "decode_rows": 1},
        {"t": 3.0, "event": "finish", "first_token": ["a"]},
        {"t": 4.0, "event": "finish", "first_token": ["a"]},
    ]
    summary = load_reader().summarize(events)
    assert summary["queued"] == [1.0] and summary["computed"] == [2.0]
