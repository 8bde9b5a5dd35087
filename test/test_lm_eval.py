"""lm-eval through srt gives the loglikelihoods (and greedy generations) of lm-eval's own Hugging Face backend on
the same checkpoint, with text prompts: the tasks in test/data/lm_eval, the command of docs/usage.md
(bench/lm_eval_compare.py). Before /tokenizer_info existed and the echo left out the server's <bos>, every
loglikelihood was several nats off (lm-eval's slice of the echo was shifted by one token)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
from serving_fixtures import PRESET, wait_idle

pytestmark = pytest.mark.usefixtures("one_thread")  # lm-eval's HF backend runs transformers in this process

TASK_DIR = Path(__file__).parent / "data" / "lm_eval"
sys.path.insert(0, str(Path(__file__).parents[1] / "bench"))
lm_eval_compare = pytest.importorskip("lm_eval_compare")
pytest.importorskip("lm_eval")


def test_lm_eval_through_srt_matches_its_hf_backend(shared_server, tiny_checkpoint, tmp_path, monkeypatch):
    """Against the session's server (conftest.py: the default flags, a 1 MiB body limit lm-eval stays far under)."""
    model, server = tiny_checkpoint(PRESET), shared_server
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("HF_DATASETS_CACHE", str(tmp_path / "datasets"))
    monkeypatch.chdir(TASK_DIR)  # the task files name their data by relative path
    tasks = ["srt_tiny_mc", "srt_tiny_gen"]
    srt_lm = lm_eval_compare.make_lm("local-completions", lm_eval_compare.srt_model_args(server.url, str(model)))
    assert srt_lm.tokenizer_backend == "remote"  # found /tokenizer_info and /tokenize
    srt = lm_eval_compare.evaluate(srt_lm, tasks, str(TASK_DIR))
    wait_idle(server.url)  # and leaves the shared server as it found it
    hf = lm_eval_compare.evaluate(lm_eval_compare.make_lm("hf", lm_eval_compare.hf_model_args(str(model))), tasks, ".")
    result = lm_eval_compare.compare(srt, hf)
    print(result.summary())
    assert result.loglikelihoods == 32 and result.generations == 4
    assert result.max_abs_delta <= lm_eval_compare.DEFAULT_TOLERANCE, result.summary()
    assert result.differing_generations == 0, result.summary()
