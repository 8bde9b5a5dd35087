"""KV pool sizing: ratio rules, exact bytes per token, weight counting, concurrency and the CLI report."""

from __future__ import annotations

import json

import pytest
import torch
from transformers import Gemma4ForCausalLM

from srt.configs.model_config import ModelConfig
from srt.mem_cache.memory_plan import (
    RULE_DENSE,
    RULE_MOE,
    RULE_USER,
    MemoryPlan,
    concurrency,
    count_weight_bytes,
    plan_memory,
)
from srt.tools import memory_plan as memory_plan_tool

GIB = 2**30


def plan_for(name: str, gpu_gib: float = 80, ratio: float | None = None) -> MemoryPlan:
    config = ModelConfig.from_preset(name)
    weights = count_weight_bytes(config, torch.bfloat16)
    return plan_memory(
        config,
        torch.bfloat16,
        weights,
        device_memory_bytes=int(gpu_gib * GIB),
        mem_fraction_static=0.85,
        swa_full_tokens_ratio=ratio,
    )


def test_default_ratio_is_015_for_moe_and_08_for_dense_and_a_users_value_wins() -> None:
    moe, dense = plan_for("gemma-4-26B-A4B-it"), plan_for("gemma-4-31B-it")
    assert (moe.swa_full_tokens_ratio, moe.ratio_rule) == (0.15, RULE_MOE) == (0.15, "default for MoE checkpoints")
    assert (dense.swa_full_tokens_ratio, dense.ratio_rule) == (0.8, RULE_DENSE)
    assert "(default for MoE checkpoints)" in moe.summary()
    for name in ("gemma-4-26B-A4B-it", "gemma-4-31B-it"):
        user = plan_for(name, ratio=0.5)
        assert (user.swa_full_tokens_ratio, user.ratio_rule) == (0.5, RULE_USER)
        assert user.swa_tokens == int(0.5 * user.full_tokens)
        assert "(user)" in user.summary()
    with pytest.raises(ValueError, match="in \\(0, 1\\]"):
        plan_for("gemma-4-31B-it", ratio=1.5)


def test_kv_bytes_per_token_count_only_layers_that_own_kv() -> None:
    # E4B: 42 layers, 5 sliding : 1 full, the last 18 share KV -> 24 owners (20 sliding, 4 full).
    # Sliding: 2 KV heads x 256 dims x (K, V) x 2 bytes; full: 2 KV heads x 512 dims x 2 x 2 bytes.
    plan = plan_for("gemma-4-E4B-it")
    assert plan.swa_bytes_per_token == 20 * 2 * 256 * 2 * 2 == 40960
    assert plan.full_bytes_per_token == 4 * 2 * 512 * 2 * 2 == 16384
    # 26B-A4B: 30 layers (25 sliding with 8 KV heads, 5 full with 2), no KV sharing.
    moe = plan_for("gemma-4-26B-A4B-it")
    assert (moe.swa_bytes_per_token, moe.full_bytes_per_token) == (25 * 8 * 256 * 4, 5 * 2 * 512 * 4)


def test_pools_fill_the_budget_at_the_chosen_ratio() -> None:
    plan = plan_for("gemma-4-E4B-it")
    assert plan.kv_budget_bytes == int(80 * GIB * 0.85) - plan.weight_bytes
    per_full_token = plan.full_bytes_per_token + 0.8 * plan.swa_bytes_per_token
    assert plan.full_tokens == int(plan.kv_budget_bytes // per_full_token)
    assert plan.swa_tokens == int(0.8 * plan.full_tokens)
    assert plan.kv_bytes <= plan.kv_budget_bytes < plan.kv_bytes + per_full_token + plan.swa_bytes_per_token


def test_max_total_tokens_overrides_and_must_fit() -> None:
    config = ModelConfig.from_preset("gemma-4-E4B-it")
    plan = plan_memory(config, torch.bfloat16, 0, max_total_tokens=1000)
    assert (plan.full_tokens, plan.swa_tokens, plan.sized_by) == (1000, 800, "max_total_tokens")
    assert plan.kv_budget_bytes == plan.kv_bytes == 1000 * 16384 + 800 * 40960
    with pytest.raises(ValueError, match="max_total_tokens 1000 needs"):
        plan_memory(config, torch.bfloat16, 0, device_memory_bytes=10**7, max_total_tokens=1000)


def test_weights_that_do_not_fit_are_a_clear_error() -> None:
    with pytest.raises(ValueError, match="no memory left for the KV cache"):
        plan_for("gemma-4-31B-it", gpu_gib=40)


def test_weight_bytes_match_the_materialized_model_with_the_tied_head_counted_once() -> None:
    config = ModelConfig.from_preset("tiny-gemma-4-E4B-it")
    model = Gemma4ForCausalLM(config.hf_text_config)
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
    # Every parameter entry, the tied head included, deduplicated by the memory it really occupies.
    storages = {p.data_ptr(): p.numel() for _, p in model.named_parameters(remove_duplicate=False)}
    assert len(storages) == len(list(model.named_parameters(remove_duplicate=False))) - 1
    assert count_weight_bytes(config, torch.float32) == sum(storages.values()) * 4
    assert count_weight_bytes(config, torch.bfloat16) * 2 == count_weight_bytes(config, torch.float32)


def test_concurrency_is_limited_by_the_scarcer_pool() -> None:
    config = ModelConfig.from_preset("tiny-gemma-4-E4B-it")  # sliding window 16
    plan = plan_memory(config, torch.float32, 0, max_total_tokens=1000, swa_full_tokens_ratio=0.1)
    fit = concurrency(plan, config, context_len=64)
    assert (fit.requests, fit.limited_by) == (100 // 16, "swa pool")  # full pool alone would allow 15
    fit = concurrency(plan, config, context_len=8)  # shorter than the window: 8 SWA tokens each
    assert (fit.requests, fit.limited_by) == (12, "swa pool")


def test_cli_report_for_e4b_at_8k_on_80gb_beats_the_naive_layout(capsys: pytest.CaptureFixture[str]) -> None:
    memory_plan_tool.main(
        ["--model", "gemma-4-E4B-it", "--gpu-memory-gb", "80", "--context-len", "8192", "--mem-fraction-static", "0.85"]
    )
    report = json.loads(capsys.readouterr().out)
    assert report["ratio_rule"] == "default for dense checkpoints" and report["swa_full_tokens_ratio"] == 0.8
    assert report["kv_bytes_per_token"] == {"full_pool": 16384, "swa_pool": 40960, "naive_all_layers": 100352}
    # Naive: every one of the 42 layers keeps K and V of all 8192 tokens of every request.
    assert report["naive_concurrent_requests"] == report["kv_budget_bytes"] // (100352 * 8192) == 70
    assert report["concurrent_requests"] == report["full_pool_tokens"] // 8192 == 144
    assert report["extra_requests_vs_naive"] == 74
    assert report["with_ratio_matched_to_context"]["swa_full_tokens_ratio"] == 512 / 8192


def test_cli_keeps_a_users_ratio_and_reports_errors(capsys: pytest.CaptureFixture[str]) -> None:
    memory_plan_tool.main(
        [
            "--model",
            "gemma-4-26B-A4B-it",
            "--gpu-memory-gb",
            "80",
            "--swa-full-tokens-ratio",
            "0.3",
            "--context-len",
            "4096",
        ]
    )
    report = json.loads(capsys.readouterr().out)
    assert (report["swa_full_tokens_ratio"], report["ratio_rule"]) == (0.3, "user")
    with pytest.raises(SystemExit):
        memory_plan_tool.main(["--model", "gemma-4-31B-it", "--gpu-memory-gb", "24"])
    assert "no memory left for the KV cache" in capsys.readouterr().err
