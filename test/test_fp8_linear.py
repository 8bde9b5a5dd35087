"""FP8 projections kept in FP8 (#26): `Fp8Linear` against its dequantized weight, FP8 checkpoints loaded with
FP8 projections against the same checkpoint dequantized at load, `--quantization fp8` against the 16-bit model
(the logit error reported and bounded), the activation-quantization reference, and the errors for what is not
supported. GPU: the prefill GEMMs (`torch._scaled_mm`, the block fallback) at real shapes."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from fp8_fixtures import fp8_layer, relative_error
from test_scheduler import greedy, make_scheduler, prompts
from torch import nn

from srt.kernels.fp8_quant import quantize_fp8_reference
from srt.layers.fp8_linear import (
    Fp8Linear,
    block_gemm_applies,
    dequantize_activations,
    fp8_linear,
    scaled_mm_applies,
    stack_fp8,
)
from srt.layers.linear import stack_linears
from srt.managers.inprocess import run_to_completion
from srt.model_loader.fp8 import Fp8Scheme, quantize
from srt.model_loader.fp8_model import emulate_fp8_activations
from srt.server_args import ServerArgs
from srt.tools.make_checkpoint import make_checkpoint

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.mark.parametrize("strategy", ["channel", "block"])
def test_stacked_fp8_projections_multiply_as_their_dequantized_weights(strategy: str) -> None:
    """Dims that are no multiples of 128 (q 200 x 300, k 72 x 300): the row-form block scales stack along N."""
    q, k = fp8_layer(200, 300, strategy, seed=1), fp8_layer(72, 300, strategy, seed=2)
    stacked = stack_linears(q, k)
    assert isinstance(stacked, Fp8Linear) and stacked.weight.dtype == torch.float8_e4m3fn
    expected_weight = torch.cat([q.dequantized(torch.float32), k.dequantized(torch.float32)])
    assert torch.equal(stacked.dequantized(torch.float32), expected_weight)
    x = torch.randn(5, 300)
    torch.testing.assert_close(stacked(x), F.linear(x, expected_weight), rtol=1e-6, atol=1e-6)


def test_block_scales_in_row_form_equal_the_checkpoints_tiles() -> None:
    weight = torch.randn(200, 300)
    scheme = Fp8Scheme("block")
    q, scale = quantize(weight, scheme)
    layer = fp8_layer(200, 300, "block")
    layer.weight.copy_(q)
    layer.weight_scale.copy_(layer.scale_from_checkpoint(scale))
    from srt.model_loader.fp8 import dequantize

    assert torch.equal(layer.dequantized(torch.float32), dequantize(q, scale, scheme, torch.float32))


def test_mixed_stacks_fall_back_to_16_bits_and_mismatched_fp8_ones_fail() -> None:
    q, k = fp8_layer(64, 128, "channel"), nn.Linear(128, 32, bias=False)
    mixed = stack_linears(q, k)
    assert type(mixed) is nn.Linear
    assert torch.equal(mixed.weight, torch.cat([q.dequantized(torch.float32), k.weight]))
    with pytest.raises(ValueError, match="cannot stack FP8 projections"):
        stack_fp8(q, fp8_layer(64, 128, "block"))


@pytest.mark.parametrize("group", [None, 128])
def test_activation_quantization_reference_is_bounded(group: int | None) -> None:
    """e4m3 keeps 4 significant bits: each value within 2^-4 of itself, or half a subnormal step (scale *
    2^-10) below the normal range; per token ([T, 1] scales) or per token and 128-column group."""
    x = torch.randn(7, 300) * torch.logspace(-3, 1, 300)  # columns of very different sizes
    q, scale = quantize_fp8_reference(x, group)
    assert q.dtype == torch.float8_e4m3fn and scale.shape == ((7, 1) if group is None else (7, 3))
    back = dequantize_activations(q, scale, group)
    step = scale.repeat_interleave(group or 300, dim=1)[:, :300] * 2**-10
    assert bool(((back - x).abs() <= torch.maximum(x.abs() * 2**-4, step) * (1 + 1e-6)).all())
    # the W8A8 product of a layer against its 16-bit product (reported): a few percent at most
    layer = fp8_layer(64, 300, "channel" if group is None else "block")
    layer.emulate_activations = True
    exact = F.linear(x, layer.dequantized(torch.float32))
    error = relative_error(layer(x), exact)
    print(f"W8A8 product error (group {group}): {error:.4f} of the largest output")
    assert 0 < error < 0.05


def logprob_runs(path, prompt_ids, **overrides) -> tuple[dict, object]:
    scheduler = make_scheduler(path, **overrides)
    return scheduler, run_prompts(scheduler, prompt_ids)


def run_prompts(scheduler, prompt_ids) -> dict:
    requests = [
        greedy(f"p{i}", ids, max_new_tokens=4, return_logprob=True, logprob_start_len=1, top_logprobs_num=1)
        for i, ids in enumerate(prompt_ids)
    ]
    return run_to_completion(scheduler, requests)


def logprob_gaps(expected: dict, got: dict) -> tuple[list[float], float]:
    """|Δ logprob| of every prompt token, and how often the top-1 token agrees (teacher-forced greedy)."""
    gaps, same = [], []
    for rid, result in expected.items():
        for a, b in zip(result.input_logprobs, got[rid].input_logprobs):
            gaps.append(abs(a.logprob - b.logprob))
            same.append(a.top[0][0] == b.top[0][0])
    return gaps, sum(same) / len(same)


@pytest.mark.parametrize("scheme", ["fp8-dynamic", "fp8-block"])
def test_fp8_checkpoint_keeps_fp8_projections_with_the_dequantized_logits(tmp_path, scheme) -> None:
    """Weight-only FP8 on CPU multiplies by the same dequantized weights: equal up to float32 rounding."""
    path = make_checkpoint("tiny-gemma-4-E4B-it", tmp_path / "fp8", quantize=scheme)
    ids = prompts(2, seed=3, low=10, high=16)
    kept, kept_out = logprob_runs(path, ids)
    reference, reference_out = logprob_runs(path, ids, dequantize_fp8_weights=True)
    layer = kept.runner.model.model.layers[0]
    for module in (layer.self_attn.qkv_proj, layer.self_attn.o_proj, layer.mlp.gate_up_proj, layer.mlp.down_proj):
        assert isinstance(module, Fp8Linear) and module.weight.dtype == torch.float8_e4m3fn
    shared = kept.runner.model.model.layers[-1].self_attn  # a KV-shared layer: q and o only
    assert isinstance(shared.q_proj, Fp8Linear)
    assert type(layer.per_layer_input_gate) is nn.Linear  # quantized in the checkpoint, dequantized at load
    assert kept.runner.memory_plan.weight_bytes < reference.runner.memory_plan.weight_bytes
    gaps, agree = logprob_gaps(reference_out, kept_out)
    assert max(gaps) < 1e-4 and agree == 1.0
    assert [kept_out[r].output_ids for r in kept_out] == [reference_out[r].output_ids for r in reference_out]


def test_multimodal_fp8_checkpoint_keeps_its_text_projections_in_fp8(tmp_path) -> None:
    """Published FP8 checkpoints are Gemma4ForConditionalGeneration (text under model.language_model.): the text
    decoder's projections load as Fp8Linears equal to the dequantized load; the vision tower stays 16-bit."""
    from srt.configs.model_config import ModelConfig
    from srt.model_loader.loader import load_model

    path = make_checkpoint("tiny-gemma-4-E4B-it", tmp_path / "mm", multimodal=True, quantize="fp8-block")
    config, cpu = ModelConfig.from_pretrained(path), torch.device("cpu")
    kept = load_model(config, path, "safetensors", torch.float32, cpu)
    reference = load_model(config, path, "safetensors", torch.float32, cpu, dequantize_fp8=True)
    assert not any(isinstance(m, Fp8Linear) for m in kept.vision_tower.modules())
    for kept_layer, reference_layer in zip(kept.model.layers, reference.model.layers):
        for name in ("self_attn.o_proj", "mlp.gate_up_proj", "mlp.down_proj"):
            module = kept_layer.get_submodule(name)
            assert isinstance(module, Fp8Linear) and module.block == (128, 128), name
            assert torch.equal(module.dequantized(torch.float32), reference_layer.get_submodule(name).weight), name


def test_online_fp8_logit_error_against_16_bits_is_reported_and_bounded(tiny_checkpoint) -> None:
    """`--quantization fp8` on the float32 tiny checkpoint, weight-only (the CPU path) and with activations
    quantized as the GPU's prefill does (W8A8). The tiny random model is chaotic (bf16 rounding alone moves its
    logprobs by up to ~0.7), so the bounds are against an unrelated model (another seed, mean |Δ| ~2.1):
    measured mean |Δ logprob| 0.41 (W8) and 0.54 (W8A8)."""
    path = tiny_checkpoint("tiny-gemma-4-E4B-it")
    ids = prompts(2, seed=6, low=20, high=30)
    _, base = logprob_runs(path, ids)
    quantized, w8 = logprob_runs(path, ids, quantization="fp8")
    assert isinstance(quantized.runner.model.model.layers[0].mlp.down_proj, Fp8Linear)
    emulate_fp8_activations(quantized.runner.model)
    w8a8 = run_prompts(quantized, ids)
    _, other = logprob_runs(tiny_checkpoint("tiny-gemma-4-E4B-it", seed=1), ids)
    report = {}
    for name, run in (("W8", w8), ("W8A8", w8a8), ("other seed", other)):
        gaps, agree = logprob_gaps(base, run)
        report[name] = (sum(gaps) / len(gaps), max(gaps), agree)
        print(f"{name}: mean |Δ logprob| {report[name][0]:.3f}, max {report[name][1]:.3f}, top-1 agree {agree:.0%}")
    unrelated = report["other seed"][0]
    assert report["W8"][0] < 0.35 * unrelated and report["W8A8"][0] < 0.45 * unrelated
    assert report["W8"][2] > report["other seed"][2] + 0.3  # teacher-forced greedy mostly agrees


def test_unsupported_quantization_fails_with_the_reason(tiny_checkpoint) -> None:
    with pytest.raises(ValueError, match="quantization must be one of fp8"):
        ServerArgs(model_path="x", quantization="int4")
    from srt.configs.model_config import ModelConfig
    from srt.model_loader.loader import load_model

    path = tiny_checkpoint("tiny-gemma-4-E4B-it")
    with pytest.raises(ValueError, match="quantization must be one of fp8"):
        load_model(ModelConfig.from_pretrained(path), path, "safetensors", torch.float32, torch.device("cpu"),
                   quantization="awq")  # fmt: skip
    attention = make_scheduler(path).runner.model.model.layers[0].self_attn
    attention.qkv_proj = None
    with pytest.raises(RuntimeError, match="after fuse_projections"):
        attention.quantize_fp8()


# E4B gate_up and down, 31B qkv (full layers) and down, at a prefill's 512 rows
PREFILL_SHAPES = [(20480, 2560), (2560, 10240), (18432, 5376), (5376, 21504)]


@pytest.mark.gpu
@pytest.mark.parametrize("strategy", ["channel", "block"])
def test_prefill_gemms_at_real_shapes(strategy: str) -> None:
    """torch._scaled_mm on per-token FP8 activations (per channel) and the block-scaled Triton GEMM on per-128-group
    ones (blocks) against the same W8A8 math in float32 (within bf16 output rounding), and against the 16-bit
    product (the W8A8 error: a few percent)."""
    group = None if strategy == "channel" else 128
    for n, k in PREFILL_SHAPES:
        layer = fp8_layer(n, k, strategy, "cuda")
        x = torch.randn(512, k, device="cuda").bfloat16()
        assert (scaled_mm_applies if strategy == "channel" else block_gemm_applies)(x, layer)
        out = fp8_linear(x, layer)
        assert out.dtype == torch.bfloat16 and out.shape == (512, n)
        weight = layer.dequantized(torch.float32)
        emulated = F.linear(dequantize_activations(*quantize_fp8_reference(x, group), group), weight)
        assert relative_error(out, emulated) < 1e-2, (n, k)
        assert relative_error(out, F.linear(x.float(), weight)) < 0.05, (n, k)


def test_online_quantization_is_per_channel_and_row_major() -> None:
    linear = nn.Linear(300, 200, bias=False)
    linear.weight = nn.Parameter(linear.weight.detach().t().contiguous().t())  # stored transposed, as srt's
    layer = Fp8Linear.quantized(linear)
    assert layer.weight.is_contiguous() and layer.weight_scale.shape == (200, 1) and layer.block is None
    q, scale = quantize(linear.weight.detach(), Fp8Scheme("channel"))  # the checkpoint tool's per-channel scheme
    assert torch.equal(layer.weight.float(), q.float()) and torch.equal(layer.weight_scale, scale)
