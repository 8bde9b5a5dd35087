"""`--kv-cache-dtype fp8_e4m3` end to end on CPU: tiny models with FP8 KV against the same models with float32
KV, checkpoint KV scales, the memory plan, the flag, and the MTP drafter reading FP8 KV.

Why the models get a rescaled q_norm. The tiny checkpoints attend with scale 1 over q and k that are RMS-normed
with weights ~1 at head_dim 32: scores have std ~sqrt(32), so each softmax is nearly one-hot and decided by
near ties, and any rounding of K/V flips some of them (even float16 KV, 11 mantissa bits, moves the tiny 31B's
logits by up to 23% of the largest one). With q_norm's weights x0.2 (score std ~1) bf16 KV moves logits by
<= 1.2% and never changes a greedy token: a model on which KV rounding is measurable rather than chaotic.

The bound. FP8 e4m3 keeps 3 mantissa bits (relative rounding error <= 2^-4 per element), 4 fewer than bf16:
its logit errors are about 16x bf16's. Measured on the three variants: prefill logits within 3-22% of the
largest logit (max over prompts), so FP8_REL_TOL = 0.3; greedy tokens agree until a near tie, so the bound on
greedy agreement is the near-tie rule of test_model_vs_transformers: wherever the FP8 run's first token differs
from the float32 run's, the float32 logits of the two are within twice the measured logit error. Both are
printed (`pytest -s`).
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from test_mtp_drafter import prefill_prompts

from srt.configs.model_config import ModelConfig
from srt.entrypoints.launch_server import parse_args
from srt.kernels.kv_quant import FP8_KV_DTYPE
from srt.layers.attention.triton_backend import TritonAttentionBackend
from srt.mem_cache.allocator import SWATokenAllocator
from srt.mem_cache.kv_cache_dtype import KVScales
from srt.mem_cache.kv_pool import HybridKVPool
from srt.mem_cache.memory_plan import count_weight_bytes, plan_memory
from srt.model_executor.model_runner import ModelRunner
from srt.model_executor.static_batch import generate_greedy
from srt.server_args import ServerArgs
from srt.speculative.frozen_kv_mtp import DraftRequests
from srt.tools import memory_plan as memory_plan_tool

pytestmark = pytest.mark.usefixtures("one_thread")  # conftest: tiny matmuls run faster on one thread

PROMPT_LENS = (5, 23, 41)  # the last two are longer than the sliding window (16)
DECODE_STEPS = 4
Q_NORM_FACTOR = 0.2
FP8_REL_TOL = 0.3
DUMMY = ("--model", "tiny-gemma-4-E4B-it", "--load-format", "dummy")


def well_conditioned(path: Path, out: Path, kv_scales: dict[str, float] | None = None) -> Path:
    """A copy of a tiny checkpoint with q_norm weights x Q_NORM_FACTOR (module docstring) and, optionally, extra
    tensors (KV cache scales under their checkpoint names)."""
    shutil.copytree(path, out)
    state = load_file(out / "model.safetensors")
    for name in state:
        if name.endswith("self_attn.q_norm.weight"):
            state[name] = state[name] * Q_NORM_FACTOR
    for name, value in (kv_scales or {}).items():
        state[name] = torch.tensor(value, dtype=torch.float32)
    save_file(state, out / "model.safetensors", metadata={"format": "pt"})
    return out


def runner_for(path: Path, kv_cache_dtype: str, **kwargs) -> ModelRunner:
    args = {"max_total_tokens": 512, "swa_full_tokens_ratio": 1.0, **kwargs}
    return ModelRunner(ServerArgs(model_path=str(path), kv_cache_dtype=kv_cache_dtype, **args))


def prompts(vocab_size: int) -> list[list[int]]:
    generator = torch.Generator().manual_seed(3)
    return [torch.randint(3, vocab_size, (n,), generator=generator).tolist() for n in PROMPT_LENS]


@pytest.mark.parametrize("variant", ["tiny-gemma-4-E4B-it", "tiny-gemma-4-26B-A4B-it", "tiny-gemma-4-31B-it"])
def test_fp8_kv_tracks_float32_kv(tiny_checkpoint, tmp_path: Path, variant: str) -> None:
    """E4B: KV-shared layers read FP8 KV of their owners; 26B-A4B: MoE, 8 KV heads on sliding layers; 31B: k_eq_v
    full layers. Sliding and full layers in all three."""
    path = well_conditioned(tiny_checkpoint(variant), tmp_path / variant)
    runs = {}
    for kv in ("auto", "fp8_e4m3"):
        runner = runner_for(path, kv)
        runs[kv] = generate_greedy(runner, prompts(runner.model_config.vocab_size), DECODE_STEPS)
        runner.kv_pool.check_integrity()
    assert runner.kv_pool.dtype == FP8_KV_DTYPE and runner.kv_pool.quantized
    exact, fp8 = runs["auto"], runs["fp8_e4m3"]
    prefill, prefill_fp8 = exact.step_logits[0], fp8.step_logits[0]
    errors = ((prefill_fp8 - prefill).abs().amax(-1) / prefill.abs().amax(-1)).tolist()
    agreed = [
        next((i for i, (a, b) in enumerate(zip(x, y, strict=True)) if a != b), len(x))
        for x, y in zip(exact.output_ids, fp8.output_ids, strict=True)
    ]
    print(
        f"{variant} fp8 vs float32 KV: prefill logit error / max logit {[round(e, 4) for e in errors]}, "
        f"greedy tokens equal for the first {agreed} of {DECODE_STEPS + 1}"
    )
    assert 0 < max(errors) < FP8_REL_TOL
    for i, first in enumerate(x[0] for x in fp8.output_ids):
        row = prefill[i]
        gap = float(row.max() - row[first])
        assert gap <= 2 * errors[i] * float(row.abs().max()), f"prompt {i}: token {first} is no near tie ({gap})"


def test_memory_plan_fits_twice_the_tokens() -> None:
    """One byte per element instead of bf16's two: the same budget holds twice the tokens, and the log line
    says what the pools store."""
    config = ModelConfig.from_preset("gemma-4-E4B-it")
    weights = count_weight_bytes(config, torch.bfloat16)
    plans = {
        kv: plan_memory(
            config, torch.bfloat16, weights, device_memory_bytes=80 * 2**30, kv_dtype=kv, mem_fraction_static=0.85
        )
        for kv in (torch.bfloat16, FP8_KV_DTYPE)
    }
    bf16, fp8 = plans[torch.bfloat16], plans[FP8_KV_DTYPE]
    assert 2 * fp8.full_bytes_per_token == bf16.full_bytes_per_token
    assert 2 * fp8.swa_bytes_per_token == bf16.swa_bytes_per_token
    assert abs(fp8.full_tokens - 2 * bf16.full_tokens) <= 1 and abs(fp8.swa_tokens - 2 * bf16.swa_tokens) <= 2
    assert fp8.kv_budget_bytes == bf16.kv_budget_bytes
    assert "float8_e4m3fn KV" in fp8.summary() and "bfloat16 KV" in bf16.summary()
    # the memory_plan tool reports it: E4B on 80 GiB at 8192 tokens a request, 144 -> 288 requests at once
    reports = [memory_plan_tool.build_report("gemma-4-E4B-it", 80, context_len=8192, kv_cache_dtype=kv)
               for kv in ("auto", "fp8_e4m3")]  # fmt: skip
    assert [r["kv_cache_dtype"] for r in reports] == ["bfloat16", "float8_e4m3fn"]
    assert reports[1]["full_pool_tokens"] == fp8.full_tokens
    assert reports[1]["concurrent_requests"] == 2 * reports[0]["concurrent_requests"]
    # the runner's plan follows the flag
    args = ServerArgs(model_path="tiny-gemma-4-E4B-it", load_format="dummy", kv_cache_dtype="fp8_e4m3")
    runner = ModelRunner(args)
    assert runner.memory_plan.kv_dtype == FP8_KV_DTYPE == runner.kv_pool.dtype


def test_the_flag_and_a_clear_error_for_other_values() -> None:
    assert ServerArgs().kv_cache_dtype == "auto"
    assert parse_args([*DUMMY, "--kv-cache-dtype", "fp8_e4m3"]).kv_cache_dtype == "fp8_e4m3"
    with pytest.raises(ValueError, match="kv_cache_dtype must be one of auto, fp8_e4m3; got 'fp8_e5m2'"):
        ServerArgs(kv_cache_dtype="fp8_e5m2")
    with pytest.raises(SystemExit):
        parse_args([*DUMMY, "--kv-cache-dtype", "int8"])


def scale_names(config: ModelConfig) -> tuple[dict[str, float], dict[int, KVScales]]:
    """Checkpoint KV scales in every naming the loader accepts, and the scales each owning layer should get:
    layer 0 self_attn.k_scale / v_scale, layer 1 k_proj / v_proj.output_scale, layer 2 the deprecated kv_scale,
    layer 3 only a K scale (V keeps 1.0), the rest none (1.0); plus one for a KV-shared layer, which is ignored."""
    attn = "model.layers.{}.self_attn."
    names = {
        attn.format(0) + "k_scale": 0.5,
        attn.format(0) + "v_scale": 0.25,
        attn.format(1) + "k_proj.output_scale": 2.0,
        attn.format(1) + "v_proj.output_scale": 0.125,
        attn.format(2) + "kv_scale": 0.75,
        attn.format(3) + "k_scale": 1.5,
    }
    shared = [spec.layer_id for spec in config.layers if not spec.owns_kv]
    names[attn.format(shared[0]) + "k_scale"] = 64.0
    expected = {0: KVScales(0.5, 0.25), 1: KVScales(2.0, 0.125), 2: KVScales(0.75, 0.75), 3: KVScales(1.5, 1.0)}
    return names, expected


def test_checkpoint_kv_scales_reach_every_reader(tiny_checkpoint, tmp_path: Path) -> None:
    """E4B with scales in the checkpoint: the pool holds them for the owning layers, KV-shared layers and the
    MTP assistant's layers read their owner's; with `auto` the same checkpoint loads and the scales stay 1."""
    config = ModelConfig.from_name_or_path(str(tiny_checkpoint("tiny-gemma-4-E4B-it")))
    names, expected = scale_names(config)
    path = well_conditioned(tiny_checkpoint("tiny-gemma-4-E4B-it"), tmp_path / "scaled", names)
    assistant = tiny_checkpoint("tiny-gemma-4-E4B-it-assistant")
    runner = runner_for(path, "fp8_e4m3", speculative_draft_model_path=str(assistant))
    pool = runner.kv_pool
    for spec in pool.layers:
        want = expected.get(spec.kv_owner, KVScales(1.0, 1.0))
        assert pool.kv_scales(spec.layer_id) == want, f"layer {spec.layer_id} (owner {spec.kv_owner})"
    assert any(spec.layer_id >= config.num_layers for spec in pool.layers)  # the assistant's layers were checked
    pool.check_integrity()
    plain = runner_for(path, "auto")
    assert all(plain.kv_pool.kv_scales(spec.layer_id) == (1.0, 1.0) for spec in plain.kv_pool.layers)


def test_mtp_drafts_over_fp8_kv_match_the_reference_backend(tiny_checkpoint, tmp_path: Path) -> None:
    """The assistant reads the target's FP8 KV (checkpoint scales, `scale_names`) through the pool: the Triton
    kernels (interpreted) draft what the torch_native reference drafts over the same FP8 cache, and drafting
    writes no KV."""
    config = ModelConfig.from_name_or_path(str(tiny_checkpoint("tiny-gemma-4-E4B-it")))
    path = well_conditioned(tiny_checkpoint("tiny-gemma-4-E4B-it"), tmp_path / "scaled", scale_names(config)[0])
    assistant = tiny_checkpoint("tiny-gemma-4-E4B-it-assistant")
    runner = runner_for(path, "fp8_e4m3", speculative_draft_model_path=str(assistant), speculative_num_steps=2)
    batch_prompts = prompts(runner.model_config.vocab_size)
    rows, _, output = prefill_prompts(runner, batch_prompts)  # the FP8 cache both backends then read
    kv_before = [t.clone() for t in (*runner.kv_pool._k.values(), *runner.kv_pool._v.values())]
    requests = DraftRequests(output.logits.argmax(dim=-1), output.hidden_states.clone(), list(PROMPT_LENS), rows)
    drafts = {
        name: runner.drafter.draft(requests, runner.req_to_token_pool, runner.kv_pool, backend).tolist()
        for name, backend in (("torch_native", runner.attn_backend), ("triton", TritonAttentionBackend()))
    }
    kv_after = [*runner.kv_pool._k.values(), *runner.kv_pool._v.values()]
    assert all(torch.equal(a, b) for a, b in zip(kv_before, kv_after, strict=True)), "drafting wrote KV"
    runner.kv_pool.check_integrity()
    print(f"E4B MTP drafts over FP8 KV: {drafts}")
    assert drafts["triton"] == drafts["torch_native"]


@pytest.mark.gpu
@pytest.mark.parametrize("variant", ["tiny-gemma-4-E4B-it", "tiny-gemma-4-31B-it"])
def test_gpu_triton_over_fp8_kv_matches_torch_native(tiny_checkpoint, tmp_path: Path, variant: str) -> None:
    """On the GPU the fused store kernel writes the FP8 cache with the hardware's e4m3 casts (under both
    backends: it runs wherever the device is CUDA) and the compiled extend and decode kernels read it, decode
    through CUDA graphs; in float32 they must give the torch_native reference's greedy tokens and logits."""
    path = well_conditioned(tiny_checkpoint(variant), tmp_path / variant)
    runs = {}
    for backend in ("torch_native", "triton"):
        runner = runner_for(path, "fp8_e4m3", device="cuda", dtype="float32", attention_backend=backend)
        runs[backend] = generate_greedy(runner, prompts(runner.model_config.vocab_size), 8)
        runner.kv_pool.check_integrity()
        del runner
    assert runs["triton"].output_ids == runs["torch_native"].output_ids
    for ours, ref in zip(runs["triton"].step_logits, runs["torch_native"].step_logits, strict=True):
        torch.testing.assert_close(ours, ref, atol=1e-3, rtol=1e-3)


def test_pool_takes_scales_only_for_fp8_buffers_and_owning_layers() -> None:
    config = ModelConfig.from_preset("tiny-gemma-4-E4B-it")
    allocator = SWATokenAllocator(8, 8, "cpu")
    shared = next(spec.layer_id for spec in config.layers if not spec.owns_kv)
    with pytest.raises(ValueError, match="for FP8 KV buffers"):
        HybridKVPool(config.layers, allocator, torch.float32, "cpu", {0: KVScales(0.5, 0.5)})
    with pytest.raises(ValueError, match="owns no KV buffers"):
        HybridKVPool(config.layers, allocator, FP8_KV_DTYPE, "cpu", {shared: KVScales(0.5, 0.5)})
    with pytest.raises(ValueError, match="finite and > 0"):
        HybridKVPool(config.layers, allocator, FP8_KV_DTYPE, "cpu", {0: KVScales(0.0, 0.5)})
    pool = HybridKVPool(config.layers, allocator, FP8_KV_DTYPE, "cpu", {0: KVScales(0.1, 3.0)})
    assert pool.kv_scales(0) == (float(torch.tensor(0.1)), 3.0)  # held as float32
    # a write quantizes with the layer's scales and a read dequantizes with them; 1000 saturates at 448 * 0.1
    k = torch.tensor([[[0.3, -1000.0] * (config.layers[0].head_dim // 2)] * config.layers[0].num_kv_heads])
    slots = allocator.alloc(1)
    pool.write(0, slots, k, k)
    k_buffer, v_buffer = pool.kv_buffers(0)
    row = int(pool.layer_slots(0, slots))
    assert k_buffer.dtype == FP8_KV_DTYPE
    assert k_buffer[row, 0, :2].float().tolist() == [3.0, -448.0] and v_buffer[row, 0, :2].float().tolist() == [
        0.1015625,
        -320.0,
    ]
    pool.check_integrity()
