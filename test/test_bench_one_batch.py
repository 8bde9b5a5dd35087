"""`bench/bench_one_batch.py` as a user runs it (a subprocess writing JSON), and the floors and the
transformers baseline it reports, each checked against an independent count or run."""

from __future__ import annotations

import copy
import json
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from serving_fixtures import CHILD_ENV
from torch.utils.flop_counter import FlopCounterMode
from transformers import Gemma4ForCausalLM as ReferenceModel

from srt.configs import presets
from srt.configs.model_config import ModelConfig

REPO = Path(__file__).resolve().parents[1]
# the scripts' processes run one torch thread, as the servers' do (serving_fixtures.CHILD_ENV)
ENV = {**os.environ, **CHILD_ENV}


@pytest.fixture
def bench(monkeypatch: pytest.MonkeyPatch) -> SimpleNamespace:
    """The bench modules, imported with bench/ first on sys.path as `python bench/<script>.py` has it."""
    monkeypatch.syspath_prepend(str(REPO / "bench"))
    import batch_fit
    import floors
    import transformers_baseline

    return SimpleNamespace(floors=floors, baseline=transformers_baseline, fit=batch_fit)


def test_correctness_mode_writes_greedy_outputs_of_the_batch(tiny_checkpoint, tmp_path) -> None:
    path = tiny_checkpoint("tiny-gemma-4-E2B-it")
    prompts = [[2, 17, 300, 45], [2] + list(range(100, 130)), [2, 9]]
    prompt_file, out_file = tmp_path / "prompts.json", tmp_path / "out.json"
    prompt_file.write_text(json.dumps(prompts))
    command = [
        sys.executable, str(REPO / "bench" / "bench_one_batch.py"), "--model-path", str(path), "--device", "cpu",
        "--dtype", "float32", "--correctness-test", "--prompt-ids-file", str(prompt_file),
        "--max-new-tokens", "6", "--json", str(out_file),
    ]  # fmt: skip
    subprocess.run(command, check=True, capture_output=True, timeout=300, env=ENV)
    outputs = json.loads(out_file.read_text())["output_ids"]

    reference = ReferenceModel.from_pretrained(path, attn_implementation="eager").eval()
    for prompt, output in zip(prompts, outputs):
        expected = reference.generate(torch.tensor([prompt]), max_new_tokens=6, do_sample=False, eos_token_id=None)[
            0, len(prompt) :
        ].tolist()
        assert output == expected


def test_latency_mode_with_transformers_baseline_reports_speedups_and_floors(tiny_checkpoint, tmp_path) -> None:
    path = tiny_checkpoint("tiny-gemma-4-E4B-it")
    out_file = tmp_path / "latency.json"
    # 20 prompt tokens: past the tiny sliding window (16), so both caches' sliding layers drop keys
    command = [
        sys.executable, str(REPO / "bench" / "bench_one_batch.py"), "--model-path", str(path), "--device", "cpu",
        "--dtype", "float32", "--batch-size", "1", "2", "--input-len", "20", "--output-len", "2",
        "--baseline", "transformers", "--json", str(out_file),
    ]  # fmt: skip
    subprocess.run(command, check=True, capture_output=True, timeout=300, env=ENV)
    output = json.loads(out_file.read_text())

    assert output["baseline"] == "transformers"
    rates = output["device_rates"]
    assert rates["copy_GBps"] > 0 and rates["matmul_TFLOPs"] > 0
    # the floors count every weight matrix of the model srt ran (only norm vectors are left out)
    weights = output["weights"]
    assert 0.99 < weights["counted_bytes"] / weights["model_parameter_bytes"] <= 1
    rows = output["results"]
    assert [row["batch_size"] for row in rows] == [1, 2]
    for row in rows:
        theirs = row["transformers"]
        # both loaded the checkpoint in float32: the baseline ran the same model on the same prompts
        assert theirs["same_greedy_tokens"] is True
        assert theirs["prefill_s"] > 0 and theirs["decode_step_s"] > 0
        assert row["prefill_speedup"] == pytest.approx(theirs["prefill_s"] / row["prefill_s"])
        assert row["decode_speedup"] == pytest.approx(theirs["decode_step_s"] / row["decode_step_s"])
        for phase, time_key in (("prefill", "prefill_s"), ("decode", "decode_step_s")):
            floor = row[f"{phase}_floor"]
            compute_s = floor["flops"] / (rates["matmul_TFLOPs"] * 1e12)
            memory_s = floor["bytes"] / (rates["copy_GBps"] * 1e9)
            assert floor["seconds"] == pytest.approx(max(compute_s, memory_s))
            assert floor["bound"] == ("compute" if compute_s >= memory_s else "memory")
            assert row[f"{phase}_over_floor"] == pytest.approx(row[time_key] / floor["seconds"])
            assert theirs[f"{phase}_over_floor"] == pytest.approx(theirs[time_key] / floor["seconds"])
    # a second request doubles the FLOPs; the weights are read once for both
    assert rows[1]["prefill_floor"]["flops"] == pytest.approx(2 * rows[0]["prefill_floor"]["flops"])
    assert rows[0]["prefill_floor"]["bytes"] < rows[1]["prefill_floor"]["bytes"] < 2 * rows[0]["prefill_floor"]["bytes"]


def run_script(*args: str, timeout: float = 300) -> subprocess.CompletedProcess:
    command = [sys.executable, str(REPO / "bench" / "bench_one_batch.py"), *args]
    return subprocess.run(command, capture_output=True, text=True, timeout=timeout, env=ENV)


def test_a_batch_the_kv_pools_cannot_hold_is_refused_before_the_model_is_built() -> None:
    """31B at batch 32 x (512 + 32) on CPU: 17,408 tokens in both pools; the CPU default gives 16,384 full and
    13,107 sliding-window tokens. Building 31B's weights on CPU would take minutes and ~115 GiB: the refusal
    comes from the plan alone, in seconds."""
    done = run_script(
        "--model-path", "gemma-4-31B-it", "--load-format", "dummy", "--device", "cpu", "--batch-size", "32",
        "--input-len", "512", "--output-len", "32", timeout=60,
    )  # fmt: skip
    assert done.returncode == 1
    assert "batch 32 x (512 prompt + 32 generated) tokens = 17,408 KV tokens do not fit" in done.stderr
    assert "full 16,384 and swa 13,107 tokens" in done.stderr
    assert "Fits with: --max-total-tokens 17408 --swa-full-tokens-ratio 1" in done.stderr


def test_the_suggested_pool_flags_reach_the_runner_and_fit_exactly(tiny_checkpoint, tmp_path, bench) -> None:
    """Batch 2 x (20 + 8) holds 56 tokens at its end: 56 tokens in each pool run it, 55 are refused (in this
    process: the script's refusal path is the test above)."""
    from srt.server_args import ServerArgs

    path, out_file = tiny_checkpoint("tiny-gemma-4-E4B-it"), tmp_path / "latency.json"
    short = ServerArgs(model_path=str(path), device="cpu", max_total_tokens=55, swa_full_tokens_ratio=1)
    with pytest.raises(SystemExit, match="56 KV tokens do not fit the KV pools: full 55 and swa 55"):
        bench.fit.refuse_unfit(short, [bench.fit.uniform_batch(2, 20, 8 + 1)])  # the prefill, then 8 steps
    common = ["--model-path", str(path), "--device", "cpu", "--dtype", "float32", "--batch-size", "1", "2"]
    common += ["--input-len", "20", "--output-len", "8", "--swa-full-tokens-ratio", "1"]
    done = run_script(*common, "--max-total-tokens", "56", "--json", str(out_file))
    assert done.returncode == 0, done.stderr[-2000:]
    output = json.loads(out_file.read_text())
    assert output["kv_pools"] == {"full_tokens": 56, "swa_tokens": 56, "sized_by": "max_total_tokens"}
    assert [row["batch_size"] for row in output["results"]] == [1, 2]


def test_gpu_plan_refusal_names_a_memory_fraction_that_fits(bench) -> None:
    """31B on an 80 GB H100 (79.2 GiB as torch reports it), bf16, the default fraction 0.85 and SWA ratio 0.8:
    the pools hold 14,760 full and 11,808 sliding-window tokens, fewer than batch 32 x 544."""
    from srt.server_args import ServerArgs

    h100 = 85_031_714_816
    need = bench.fit.uniform_batch(32, 512, 33)
    assert (need.total_tokens, need.request_tokens) == (32 * 544, 544)
    args = ServerArgs(model_path="gemma-4-31B-it", load_format="dummy")
    with pytest.raises(SystemExit, match="full 14,760 and swa 11,808 tokens") as refusal:
        bench.fit.refuse_unfit(args, [need], gpu_memory_bytes=h100)
    message = str(refusal.value)
    assert "--mem-fraction-static 0.85 of 79.2 GiB of GPU memory" in message
    assert "Fits with: --swa-full-tokens-ratio 1 --mem-fraction-static 0.91" in message
    fitting = ServerArgs(model_path="gemma-4-31B-it", swa_full_tokens_ratio=1, mem_fraction_static=0.91)
    bench.fit.refuse_unfit(fitting, [need], gpu_memory_bytes=h100)
    short = ServerArgs(model_path="gemma-4-31B-it", swa_full_tokens_ratio=1, mem_fraction_static=0.90)
    with pytest.raises(SystemExit, match="17,408 KV tokens do not fit"):
        bench.fit.refuse_unfit(short, [need], gpu_memory_bytes=h100)
    rows = ServerArgs("gemma-4-31B-it", swa_full_tokens_ratio=1, mem_fraction_static=0.91, max_running_requests=16)
    with pytest.raises(SystemExit, match="batch 32 > --max-running-requests 16.*Fits with: --max-running-requests 32"):
        bench.fit.refuse_unfit(rows, [need], gpu_memory_bytes=h100)
    too_many = ServerArgs(model_path="gemma-4-31B-it", max_total_tokens=20000)
    with pytest.raises(SystemExit, match="max_total_tokens 20000 needs 13.73 GiB of KV but only 10.13 GiB"):
        bench.fit.refuse_unfit(too_many, [need], gpu_memory_bytes=h100)


@pytest.mark.parametrize("preset", presets.preset_names())
def test_weight_counts_cover_every_parameter_of_transformers_model(bench, preset: str) -> None:
    config = ModelConfig.from_preset(preset)
    with torch.device("meta"):
        reference = ReferenceModel(config.hf_text_config)
    parameters = sum(p.numel() for p in reference.parameters())  # a tied LM head once
    counted = bench.floors.weight_counts(config).total
    assert counted <= parameters < 1.01 * counted  # all but the norm and scale vectors


@pytest.mark.parametrize("preset", ["tiny-gemma-4-E2B-it", "tiny-gemma-4-26B-A4B-it", "tiny-gemma-4-31B-it"])
def test_decode_step_flops_equal_a_flop_counter_on_transformers(bench, preset: str) -> None:
    """One decode step at 20 tokens of context (past the sliding window of 16), counted by torch's FlopCounter
    on transformers' eager attention and eager expert loop: every matmul the floor should count and no other."""
    config = ModelConfig.from_preset(preset)
    reference = ReferenceModel._from_config(
        copy.deepcopy(config.hf_text_config), attn_implementation="eager", experts_implementation="eager"
    ).eval()
    context = 20
    with torch.no_grad():
        cache = reference(input_ids=torch.arange(3, 3 + context - 1)[None], use_cache=True).past_key_values
        with FlopCounterMode(display=False) as counter:
            reference(input_ids=torch.tensor([[5]]), past_key_values=cache, use_cache=True)
    # the counter also sees RoPE's frequencies x positions matmul, which the floors leave out
    rope = sum(
        2 * b.numel() for n, b in reference.model.rotary_emb.named_buffers() if n.endswith("_attention_inv_freq")
    )
    rates = bench.floors.DeviceRates(1.0, 1.0, 0, 0)
    floor = bench.floors.decode_step_floor(config, torch.float32, rates, 1, context)
    assert counter.get_total_flops() == floor.flops + rope


def test_expected_distinct_experts_match_simulated_uniform_routing(bench) -> None:
    generator = torch.Generator().manual_seed(0)
    experts, top_k = 128, 8
    assert bench.floors.expected_distinct_experts(experts, top_k, 1) == pytest.approx(top_k)
    for tokens in (2, 8, 32):
        picks = torch.rand(4000, tokens, experts, generator=generator).topk(top_k, dim=-1).indices
        touched = torch.zeros(4000, experts).scatter_(1, picks.flatten(1), 1.0).sum(dim=1)
        expected = bench.floors.expected_distinct_experts(experts, top_k, tokens)
        assert float(touched.mean()) == pytest.approx(expected, rel=0.01)


def test_baseline_on_random_weights_decodes_as_transformers_generate(bench) -> None:
    """The meta-device build (RoPE buffers, embedding scales and the tied head set up after to_empty) and the
    timed loop (prefill, then one token per step through the KV cache) give generate()'s greedy tokens."""
    config = ModelConfig.from_preset("tiny-gemma-4-26B-A4B-it")
    model = bench.baseline.build_transformers_model(config, torch.device("cpu"), torch.float32)
    assert model.lm_head.weight is model.model.embed_tokens.weight
    assert model.config._attn_implementation == "sdpa"
    reference = ReferenceModel._from_config(copy.deepcopy(config.hf_text_config), dtype=torch.float32)
    buffers = dict(reference.named_buffers())
    for name, buffer in model.named_buffers():
        assert torch.equal(buffer, buffers[name]), name
    prompts = torch.randint(3, config.vocab_size, (2, 20), generator=torch.Generator().manual_seed(1)).tolist()
    run = bench.baseline.greedy_steps(model, prompts, 3)
    assert len(run.step_seconds) == 4
    expected = model.generate(torch.tensor(prompts), max_new_tokens=4, do_sample=False, eos_token_id=None)
    assert run.output_ids == expected[:, 20:].tolist()


def test_graph_steps_bench_times_both_ways(tiny_checkpoint, tmp_path) -> None:
    """`bench/bench_graph_steps.py` runs prefills, later chunks of a prompt and mixed steps through the padded
    token steps and eagerly (on CPU the padded steps run without graphs: a check of the script, not a measurement)."""
    out_file = tmp_path / "steps.json"
    command = [
        sys.executable,
        str(REPO / "bench" / "bench_graph_steps.py"),
        "--model-path",
        str(tiny_checkpoint("tiny-gemma-4-E4B-it")),
        "--device",
        "cpu",
        "--dtype",
        "float32",
        "--prefill-lens",
        "20",
        "50",
        "--prompt-prefix",
        "0",
        "10",
        "--decode-rows",
        "0",
        "3",
        "--decode-context",
        "30",
        "--calls",
        "1",
        "--rounds",
        "1",
        "--json",
        str(out_file),
    ]
    subprocess.run(command, check=True, cwd=REPO, capture_output=True, timeout=300, env=ENV)
    results = json.loads(out_file.read_text())["results"]
    assert [(r["prompt_prefix"], r["prompt_len"], r["decode_rows"], r["tokens"]) for r in results] == [
        (0, 20, 0, 20), (0, 50, 0, 50), (10, 20, 0, 20), (10, 50, 0, 50),
        (0, 20, 3, 23), (0, 50, 3, 53), (10, 20, 3, 23), (10, 50, 3, 53),
    ]  # fmt: skip
    assert all(r["graphs_s"] > 0 and r["eager_s"] > 0 and r["prefill_floor_s"] > 0 for r in results)


def test_speculative_mode_reports_plain_and_mtp_decoding(tmp_path) -> None:
    """With the assistant and a simulated accept length: both runs per batch size and the accept length they
    measured (CPU: no GPU times)."""
    out_file = tmp_path / "mtp.json"
    command = [
        sys.executable, str(REPO / "bench" / "bench_one_batch.py"), "--model-path", "tiny-gemma-4-E4B-it",
        "--load-format", "dummy", "--device", "cpu", "--max-total-tokens", "1024",
        "--speculative-draft-model-path", "tiny-gemma-4-E4B-it-assistant", "--batch-size", "1", "2",
        "--input-len", "16", "--output-len", "9", "--json", str(out_file), "--trace", str(tmp_path / "t.json"),
    ]  # fmt: skip
    env = {**ENV, "SRT_SIMULATE_ACCEPT_LEN": "3.0"}
    subprocess.run(command, check=True, capture_output=True, timeout=300, env=env)
    for mode in ("plain", "mtp"):  # --trace: a profile of each decode, as Chrome traces
        assert json.loads((tmp_path / f"t-{mode}.json").read_text())["traceEvents"]
    rows = json.loads(out_file.read_text())["mtp"]
    assert [row["batch_size"] for row in rows] == [1, 2]
    for row in rows:
        assert row["plain_tokens_per_s"] > 0 and row["mtp_tokens_per_s"] > 0
        assert 2.0 < row["accept_length"] <= 3.0  # 3 per round but the last rounds', cut by max_tokens
