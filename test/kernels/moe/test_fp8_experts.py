"""FP8 MoE experts (#26): `Experts.quantize_fp8` (float8_e4m3fn weights, float32 scales per output channel), the
Triton grouped GEMMs reading them, and the dequantize-then-matmul CPU path.

Oracle: `Experts.forward_reference` in float32 on the FP8 experts, which dequantizes each expert it runs
(q * scale, in float32) and multiplies; the kernels upcast the FP8 tiles and scale the accumulator's columns
instead (the same product). Bounds as in test_experts_kernels.py: float32 1e-5 relative, 16-bit activations
at most twice the 16-bit loop's own error or 1e-2. FP8 against the 16-bit experts it was quantized from (the
quantization error itself, e4m3 keeps 3 mantissa bits) is printed and held under FP8_VS_16BIT_TOL.

Model: the tiny 26B-A4B checkpoint with its experts quantized runs the CPU path against transformers on the same
checkpoint with those experts dequantized by this test's own arithmetic: greedy tokens identical, logits within
float32 rounding. On CUDA (`gpu`): the kernels at 26B-A4B's shapes (hidden 2816, 128 experts, top 8, inter
704: /work/shared/gemma4_variants.json) in bf16, in a CUDA graph, and the tiny checkpoint on the fused path.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file
from test_experts_kernels import (
    BF16_TOL,
    DEVICE,
    EXPERTS,
    FP32_TOL,
    HIDDEN,
    INTER,
    TOP_K,
    make_experts,
    make_routing,
    relative_error,
    requires_triton,
)

from srt.kernels.fp8_quant import quantize_fp8_reference
from srt.kernels.moe import experts as experts_kernels
from srt.kernels.moe.align import align_slots
from srt.layers.moe import fused_experts as fe
from srt.layers.moe.experts import Experts, quantize_experts_fp8
from srt.model_loader.fp8 import FP8, FP8_MAX

# e4m3 rounds each weight by up to 2^-4 relative; through two GEMMs the outputs measured 3.9-6.0% off at 16
# experts, hidden 80, inter 48, and 4.8-5.9% at 8 experts, hidden 40, inter 24 (fewer and smaller experts per token:
# less averaging, the larger errors)
FP8_VS_16BIT_TOL = 0.1


def fp8_copy(experts: Experts) -> Experts:
    """A quantized copy of `experts` (which stays as it is)."""
    quantized = Experts(experts.num_experts, experts.gate_up_proj.shape[2], experts.down_proj.shape[2])
    quantized.load_state_dict(experts.state_dict())
    quantized.to(experts.gate_up_proj.device)
    quantized.quantize_fp8()
    return quantized


def run_fp8(backend: str, experts: Experts, hidden: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor):
    return fe.fused_experts(
        hidden,
        experts.gate_up_proj,
        experts.down_proj,
        weights,
        ids.to(torch.int32),
        backend,
        gate_up_scale=experts.gate_up_proj_scale,
        down_scale=experts.down_proj_scale,
    )


def check_fp8(experts: Experts, hidden: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> float:
    """The FP8 triton experts against the float32 dequantized loop (asserted within bounds); returns the error."""
    w8a8 = experts_kernels.w8a8_possible(hidden, experts.gate_up_proj)
    config = experts_kernels.default_experts_config(ids.numel(), experts.num_experts, hidden.is_cuda, True, w8a8)
    with torch.no_grad():
        out = run_fp8("triton", experts, hidden, weights, ids)
        exact = experts.forward_reference(hidden.float(), weights, ids)
        loop = experts.forward_reference(hidden, weights, ids)
        if config.w8a8:  # prefill sizes on FP8 tensor cores: the activations are quantized too
            exact = w8a8_reference(experts, hidden, weights, ids)
    assert out.shape == hidden.shape and out.dtype == hidden.dtype
    error = relative_error(out, exact)
    if config.w8a8:
        assert error < BF16_TOL, error
    elif hidden.dtype == torch.float32:
        assert error < FP32_TOL, error
    else:
        assert error < max(BF16_TOL, 2 * relative_error(loop, exact)), error
    return error


def test_quantize_fp8_per_output_channel() -> None:
    experts = make_experts(4, 40, 24, torch.bfloat16)
    original = {name: p.detach().clone() for name, p in experts.named_parameters()}
    experts.quantize_fp8()
    assert experts.is_fp8
    for name, scale_shape in (("gate_up_proj", (4, 48)), ("down_proj", (4, 40))):
        q, scale = getattr(experts, name), getattr(experts, f"{name}_scale")
        assert q.dtype == FP8 and not q.requires_grad and q.shape == original[name].shape
        assert scale.dtype == torch.float32 and scale.shape == scale_shape
        w = original[name].float()
        torch.testing.assert_close(scale, w.abs().amax(dim=2) / FP8_MAX)
        # each channel's largest weight maps to +-448, and q * scale is w rounded to e4m3: 3 mantissa bits,
        # subnormal steps of 2^-9 below 2^-6
        assert torch.equal(q.float().abs().amax(dim=2), torch.full(scale_shape, FP8_MAX))
        assert ((q.float() * scale[..., None] - w).abs() <= (w.abs() * 2**-4 + scale[..., None] * 2**-10)).all()
    state = experts.state_dict()
    assert state["gate_up_proj"].dtype == FP8 and "down_proj_scale" in state
    assert {n: p.dtype for n, p in experts.named_parameters()} == {"gate_up_proj": FP8, "down_proj": FP8}


def test_cpu_forward_is_the_dequantized_loop() -> None:
    """On the CPU, FP8 experts run dequantize-then-matmul: the 16-bit loop on q * scale."""
    if DEVICE.type == "cuda":
        pytest.skip("CPU path")
    experts = fp8_copy(make_experts(8, 32, 16, torch.float32))
    dequantized = Experts(8, 32, 16)
    with torch.no_grad():
        dequantized.gate_up_proj.copy_(experts.gate_up_proj.float() * experts.gate_up_proj_scale[..., None])
        dequantized.down_proj.copy_(experts.down_proj.float() * experts.down_proj_scale[..., None])
        hidden = torch.randn(6, 32)
        weights, ids = make_routing(6, 8, 2)
        torch.testing.assert_close(experts(hidden, weights, ids), dequantized(hidden, weights, ids))


def test_fp8_experts_refuse_grouped_mm_and_default_to_triton() -> None:
    """grouped_mm multiplies 16-bit weights only (its FP8 form quantizes the activations too)."""
    experts = fp8_copy(make_experts(4, 32, 16, torch.bfloat16))
    hidden = torch.randn(2, 32).to(DEVICE, torch.bfloat16)
    weights, ids = make_routing(2, 4, 2)
    assert not fe.grouped_mm_supported(hidden, fp8=True)
    assert fe.default_backend(hidden, fp8=True) in ("triton", None)
    with pytest.raises(ValueError, match="float8_e4m3fn weights"):
        run_fp8("grouped_mm", experts, hidden, weights, ids)
    with pytest.raises(ValueError, match="both scales"):
        fe.fused_experts(hidden, experts.gate_up_proj, experts.down_proj, weights, ids, "triton")


@requires_triton
@pytest.mark.parametrize("tokens,dtype", [(4, torch.float32), (1, torch.bfloat16), (3, torch.float16)])
def test_fp8_triton_matches_dequantized_loop(tokens: int, dtype: torch.dtype) -> None:
    # inter 24 and hidden 40 are not multiples of the interpreter's 16-wide blocks: partial tiles on N and K
    experts16 = make_experts(8, 40, 24, torch.float32)
    experts = fp8_copy(experts16)
    hidden = torch.randn(tokens, 40, generator=torch.Generator().manual_seed(tokens)).to(DEVICE, dtype)
    weights, ids = make_routing(tokens, 8, 3)
    error = check_fp8(experts, hidden, weights, ids)
    with torch.no_grad():
        fp8_error = relative_error(
            run_fp8("triton", experts, hidden, weights, ids), experts16.forward_reference(hidden.float(), weights, ids)
        )
    print(f"{dtype} tokens={tokens}: vs dequantized {error:.1e}, FP8 vs 16-bit experts {fp8_error:.2e}")
    assert fp8_error < FP8_VS_16BIT_TOL


@requires_triton
def test_fp8_blocks_saturate_16_bit_rows_at_float16_max() -> None:
    """Weight-only FP8 blocks multiply 16-bit rows as float16 (one cvt per two weights on sm90), saturated at
    65504 rather than overflowing: a token with 1e6 activations gets a finite output (inf and NaN without the
    saturation), and the other tokens' rows, each its own, stay the dequantized loop's."""
    experts = fp8_copy(make_experts(8, 32, 16, torch.float32))
    hidden = torch.randn(6, 32, generator=torch.Generator().manual_seed(5)).to(DEVICE, torch.bfloat16)
    hidden[2, :4] = 1e6
    weights, ids = make_routing(6, 8, 2)
    with torch.no_grad():
        out = run_fp8("triton", experts, hidden, weights, ids).float()
        exact = experts.forward_reference(hidden.float(), weights, ids)
    assert torch.isfinite(out).all()
    others = torch.tensor([0, 1, 3, 4, 5], device=DEVICE)
    assert relative_error(out[others], exact[others]) < BF16_TOL


@requires_triton
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_swap_ab_blocks_match_the_loop(dtype: torch.dtype) -> None:
    """The kernels' swapped product (w @ x.T).T, on FP8 and on 16-bit weights."""
    experts16 = make_experts(8, 48, 32, dtype)
    hidden = torch.randn(3, 48).to(DEVICE, dtype)
    weights, ids = make_routing(3, 8, 2)
    config = experts_kernels.ExpertsConfig(16, 16, 16, 16, 4, 1, swap_ab=True)
    for experts in (fp8_copy(experts16), experts16):
        scales = {"gate_up_scale": experts.gate_up_proj_scale, "down_scale": experts.down_proj_scale}
        with torch.no_grad():
            out = fe.triton_experts(
                hidden, experts.gate_up_proj, experts.down_proj, weights, ids.int(), config=config, **scales
            )
            exact = experts.forward_reference(hidden.float(), weights, ids)  # weights upcast (or dequantized)
        assert relative_error(out, exact) < (FP32_TOL if dtype == torch.float32 else BF16_TOL)


def quantized_rows(x: torch.Tensor) -> torch.Tensor:
    """x as the W8A8 kernels multiply it, in float32: `quantize_fp8_reference` per row, dequantized."""
    q, scale = quantize_fp8_reference(x)
    return q.float() * scale


def w8a8_slots_reference(
    experts: Experts, x: torch.Tensor, ids: torch.Tensor, proj: str, weights: torch.Tensor | None = None
) -> torch.Tensor:
    """One W8A8 kernel's output per slot (slot = token * top_k + k), in float32, from float32 rows `x` (per
    token for "gate_up", per slot for "down") and the dequantized weights: gelu(gate) * up for "gate_up", times
    the routing weight for "down"."""
    tokens, top_k = ids.shape
    width = experts.gate_up_proj.shape[1] // 2 if proj == "gate_up" else experts.down_proj.shape[1]
    out = torch.empty(tokens * top_k, width, device=x.device)
    for expert in torch.unique(ids).tolist():
        token_idx, k = torch.where(ids == expert)
        slots = token_idx * top_k + k
        gate_up_proj, down_proj = experts.expert_weights(expert, torch.float32)
        if proj == "gate_up":
            gate, up = F.linear(x[token_idx], gate_up_proj).chunk(2, dim=-1)
            out[slots] = F.gelu(gate, approximate="tanh") * up
        else:
            out[slots] = F.linear(x[slots], down_proj) * weights[token_idx, k, None]
    return out


def w8a8_reference(experts: Experts, hidden: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """The W8A8 experts' output (float32): rows quantized per token, gelu(gate) * up rounded to the activations'
    dtype (the kernel stores it so) and quantized per slot, each slot's output rounded before the top_k sum."""
    act = w8a8_slots_reference(experts, quantized_rows(hidden), ids, "gate_up").to(hidden.dtype)
    per_slot = w8a8_slots_reference(experts, quantized_rows(act), ids, "down", weights).to(hidden.dtype)
    return per_slot.float().view(*ids.shape, -1).sum(dim=1)


@requires_triton
@pytest.mark.parametrize("swap_ab", [False, True])
def test_w8a8_blocks_multiply_quantized_rows(swap_ab: bool) -> None:
    """The kernels on FP8 rows with a scale per row (W8A8), each against the same product in float32 (their
    float32 outputs: exact up to float32 rounding); hidden 40 and inter 24 leave partial K-steps and tiles. The
    whole W8A8 path in bf16 stays within FP8_VS_16BIT_TOL of the 16-bit experts; FP8 rows need FP8 weights and
    their scales."""
    experts16 = make_experts(8, 40, 24, torch.float32)
    experts = fp8_copy(experts16)
    hidden = 4 * torch.randn(5, 40, generator=torch.Generator().manual_seed(5)).to(DEVICE)
    hidden[2] = 0  # a zero row: scale float32's tiny, q 0
    weights, ids = make_routing(5, 8, 3)
    config = experts_kernels.ExpertsConfig(16, 16, 16, 16, 4, 1, swap_ab=swap_ab, w8a8=True)
    blocks = align_slots(ids.int(), 8, config.block_m)
    x_q, x_scale = quantize_fp8_reference(hidden)
    with torch.no_grad():
        act = experts_kernels.grouped_gate_up(x_q, experts.gate_up_proj, *blocks, 3, config,
                                              experts.gate_up_proj_scale, x_scale, out_dtype=torch.float32)  # fmt: skip
        act_q, act_scale = quantize_fp8_reference(act)
        per_slot = experts_kernels.grouped_down(act_q, experts.down_proj, weights.reshape(-1).float(), *blocks,
                                                config, experts.down_proj_scale, act_scale, torch.float32)  # fmt: skip
    assert act.dtype == per_slot.dtype == torch.float32
    expected_act = w8a8_slots_reference(experts, x_q.float() * x_scale, ids, "gate_up")
    assert relative_error(act, expected_act) < FP32_TOL
    expected = w8a8_slots_reference(experts, act_q.float() * act_scale, ids, "down", weights)
    assert relative_error(per_slot, expected) < FP32_TOL
    assert torch.equal(per_slot.view(5, 3, -1)[2], torch.zeros(3, 40))

    scales = {"gate_up_scale": experts.gate_up_proj_scale, "down_scale": experts.down_proj_scale}
    with torch.no_grad():
        out = fe.triton_experts(hidden.bfloat16(), experts.gate_up_proj, experts.down_proj, weights, ids.int(),
                                config, **scales)  # fmt: skip
        full = experts16.forward_reference(hidden, weights, ids)
    assert out.dtype == torch.bfloat16 and relative_error(out, full) < FP8_VS_16BIT_TOL
    with pytest.raises(ValueError, match="float8_e4m3fn rows multiply float8_e4m3fn weights only"):
        experts_kernels.grouped_gate_up(x_q, experts16.gate_up_proj, *blocks, 3, config, None, x_scale)
    with pytest.raises(ValueError, match="float8_e4m3fn rows come with a scale per row"):
        experts_kernels.grouped_gate_up(x_q, experts.gate_up_proj, *blocks, 3, config, experts.gate_up_proj_scale)


def test_w8a8_is_the_prefill_default_only_where_fp8_tensor_cores_multiply_16_bit_rows() -> None:
    """Prefill sizes of FP8 experts run W8A8 on GPUs with FP8 tensor cores and 16-bit activations; float32
    activations (the exact tests), CPUs and decode sizes stay weight-only."""
    fp8 = torch.empty(2, 2, dtype=FP8)
    assert not experts_kernels.w8a8_possible(torch.empty(1, 2, dtype=torch.bfloat16), fp8)  # CPU
    if torch.cuda.is_available() and experts_kernels.has_fp8_tensor_cores(torch.device("cuda")):
        assert experts_kernels.w8a8_possible(torch.empty(1, 2, dtype=torch.bfloat16, device="cuda"), fp8.cuda())
        assert not experts_kernels.w8a8_possible(torch.empty(1, 2, device="cuda"), fp8.cuda())
    decode = experts_kernels.default_experts_config(32 * 8, 128, on_gpu=True, fp8=True, w8a8=True)
    prefill = experts_kernels.default_experts_config(7000 * 8, 128, on_gpu=True, fp8=True, w8a8=True)
    assert prefill.w8a8 and not decode.w8a8
    assert not experts_kernels.default_experts_config(7000 * 8, 128, on_gpu=True, fp8=True).w8a8


def dequantized_checkpoint(path: Path, out: Path, model: torch.nn.Module) -> int:
    """A copy of checkpoint `path` whose expert weights are the FP8 ones of `model` (srt, quantized)
    dequantized: q * scale per output channel; returns how many tensors were replaced."""
    shutil.copytree(path, out)
    tensors = load_file(out / "model.safetensors")
    modules = dict(model.named_modules())
    replaced = 0
    for name in list(tensors):
        module, _, weight = name.rpartition(".")
        experts = modules.get(module)
        if isinstance(experts, Experts) and weight in ("gate_up_proj", "down_proj"):
            q, scale = getattr(experts, weight), getattr(experts, f"{weight}_scale")
            assert q.dtype == FP8
            tensors[name] = q.float() * scale[..., None]
            replaced += 1
    save_file(tensors, out / "model.safetensors", metadata={"format": "pt"})
    return replaced


def test_tiny_26b_fp8_experts_equal_transformers_on_dequantized_weights(tiny_checkpoint, tmp_path) -> None:
    """The CPU path (dequantize-then-matmul) of a whole model against transformers on the same FP8 weights
    dequantized by the test: greedy tokens identical, every step's logits within 1e-4 relative (float32)."""
    from transformers import Gemma4ForCausalLM as ReferenceModel

    from srt.model_executor.model_runner import ModelRunner
    from srt.model_executor.static_batch import generate_greedy
    from srt.server_args import ServerArgs

    if DEVICE.type == "cuda":
        pytest.skip("CPU path")
    path = tiny_checkpoint("tiny-gemma-4-26B-A4B-it")
    runner = ModelRunner(ServerArgs(model_path=str(path), device="cpu", dtype="float32"))
    layers = quantize_experts_fp8(runner.model)
    assert layers == runner.model_config.hf_text_config.num_hidden_layers
    assert dequantized_checkpoint(path, tmp_path / "dequantized", runner.model) == 2 * layers
    assert "quantization_config" not in json.loads((path / "config.json").read_text())

    prompt = torch.randint(3, 1000, (19,), generator=torch.Generator().manual_seed(19)).tolist()
    result = generate_greedy(runner, [prompt], 4)
    reference = ReferenceModel.from_pretrained(
        tmp_path / "dequantized", dtype=torch.float32, attn_implementation="eager", experts_implementation="eager"
    ).eval()
    with torch.no_grad():
        expected = reference.generate(torch.tensor([prompt]), max_new_tokens=4, do_sample=False, eos_token_id=None)
        logits = reference(expected[:, :-1]).logits[0, len(prompt) - 1 :]
    assert result.output_ids[0] == expected[0, len(prompt) :].tolist()
    for step, ours in enumerate(result.step_logits):
        assert relative_error(ours[0], logits[step]) < 1e-4, step


# --- GPU: 26B-A4B shapes -------------------------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.parametrize("tokens", [1, 7, 32, 512, 2048])
def test_gpu_26b_shapes_fp8(tokens: int) -> None:
    experts16 = make_experts(EXPERTS, HIDDEN, INTER, torch.bfloat16)
    experts = fp8_copy(experts16)
    hidden = torch.randn(tokens, HIDDEN, device=DEVICE).to(torch.bfloat16)
    weights, ids = make_routing(tokens, EXPERTS, TOP_K, seed=tokens)
    error = check_fp8(experts, hidden, weights, ids)
    with torch.no_grad():
        fp8_error = relative_error(
            run_fp8("triton", experts, hidden, weights, ids),
            experts16.float().forward_reference(hidden.float(), weights, ids),
        )
    print(f"fp8 tokens={tokens}: vs dequantized {error:.2e}, FP8 vs bf16 experts {fp8_error:.2e}")
    assert fp8_error < FP8_VS_16BIT_TOL


@pytest.mark.gpu
def test_gpu_fp8_skewed_routing_and_float32() -> None:
    """300 tokens all on experts 5 and 77 (many row blocks each); float32 activations on FP8 weights."""
    experts = fp8_copy(make_experts(EXPERTS, HIDDEN, INTER, torch.bfloat16, seed=2))
    weights, ids = make_routing(300, EXPERTS, 2)
    ids[:, 0], ids[:, 1] = 5, 77
    check_fp8(experts, torch.randn(300, HIDDEN, device=DEVICE).to(torch.bfloat16), weights, ids)
    check_fp8(experts, torch.randn(100, HIDDEN, device=DEVICE), *make_routing(100, EXPERTS, TOP_K))


@pytest.mark.gpu
def test_gpu_fp8_experts_capture_in_a_cuda_graph() -> None:
    """Experts.forward on FP8 weights picks triton without a host sync: it replays with new routing."""
    experts = fp8_copy(make_experts(EXPERTS, HIDDEN, INTER, torch.bfloat16, seed=3))
    hidden = torch.randn(16, HIDDEN, device=DEVICE).to(torch.bfloat16)
    weights, ids = make_routing(16, EXPERTS, TOP_K)
    ids = ids.to(torch.int32)
    with torch.no_grad():
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            experts(hidden, weights, ids)
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = experts(hidden, weights, ids)
        new_weights, new_ids = make_routing(16, EXPERTS, TOP_K, seed=7)
        weights.copy_(new_weights)
        ids.copy_(new_ids)
        hidden.normal_()
        graph.replay()
        expected = experts(hidden, weights, ids)
    assert torch.equal(out, expected)


@pytest.mark.gpu
def test_gpu_tiny_26b_fp8_fused_vs_reference(tiny_checkpoint) -> None:
    """The tiny 26B-A4B checkpoint with FP8 experts in float32: the fused path (routing kernel, FP8 triton
    experts) against the torch reference (dequantized loop) on the same GPU, both eager: greedy tokens over 12
    steps identical, logits within 1e-4; then the fused path from CUDA graphs captured after quantizing (as a
    load-time hook must: graphs hold the weights' addresses) gives the eager fused outputs."""
    from srt.layers.moe.router import Router
    from srt.model_executor.model_runner import ModelRunner
    from srt.model_executor.static_batch import generate_greedy
    from srt.server_args import ServerArgs

    path = tiny_checkpoint("tiny-gemma-4-26B-A4B-it")
    prompts = [torch.randint(3, 1000, (n,), generator=torch.Generator().manual_seed(n)).tolist() for n in (5, 23, 41)]
    args = ServerArgs(
        model_path=str(path), device="cuda", dtype="float32", max_total_tokens=4096, disable_cuda_graph=True
    )
    runner = ModelRunner(args)
    assert quantize_experts_fp8(runner.model) > 0
    results = {}
    for name, backend in (("reference", "torch"), ("fused", "auto")):
        for module in runner.model.modules():
            if isinstance(module, Router | Experts):
                module.backend = backend
        results[name] = generate_greedy(runner, prompts, 12)
    runner.capture_cuda_graphs()
    results["graphs"] = generate_greedy(runner, prompts, 12)
    for name, reference in (("fused", "reference"), ("graphs", "fused")):
        assert results[name].output_ids == results[reference].output_ids, name
        for ours, ref in zip(results[name].step_logits, results[reference].step_logits, strict=True):
            assert relative_error(ours, ref) < 1e-4, name
