"""srt's Gemma 4 text model against transformers' Gemma4ForCausalLM on tiny checkpoints of every variant.

Each batch holds prompts shorter and longer than the sliding window (16 in tiny presets) and runs one prefill
and 16 greedy decode steps through srt's paged-KV path; transformers recomputes every step from the full
sequence of the same prompt alone.

Tolerance: in float32 the bound is 1e-4 relative, or twice transformers' own float32 error against its
float64 result where that is larger: on some random checkpoints (tiny 31B) float32 rounding alone moves the
reference's logits by ~1.2e-4, and no implementation can be held closer to it than it is to its own float64
answer. (A float64 run is no cleaner: both implementations compute every RMSNorm in float32.)
"""

from __future__ import annotations

import pytest
import torch
from transformers import Gemma4ForCausalLM as ReferenceModel

from srt.model_executor.model_runner import ModelRunner
from srt.model_executor.static_batch import generate_greedy
from srt.server_args import ServerArgs

VARIANTS = ["tiny-gemma-4-E2B-it", "tiny-gemma-4-E4B-it", "tiny-gemma-4-26B-A4B-it", "tiny-gemma-4-31B-it"]
PROMPT_LENS = (5, 23, 41)  # the last two are longer than the sliding window
DECODE_STEPS = 16
FP32_REL_TOL = 1e-4
# bf16 keeps 8 mantissa bits: after a dozen layers logits move by a few % of the largest one.
BF16_REL_TOL = 3e-2


def relative_error(ours: torch.Tensor, reference: torch.Tensor) -> float:
    """Largest absolute difference over the largest reference magnitude."""
    return float((ours.double() - reference.double()).abs().max() / reference.double().abs().max())


def random_prompts(vocab_size: int, seed: int = 1) -> list[list[int]]:
    generator = torch.Generator().manual_seed(seed)
    return [torch.randint(3, vocab_size, (n,), generator=generator).tolist() for n in PROMPT_LENS]


def load_reference(path, dtype: torch.dtype) -> ReferenceModel:
    return ReferenceModel.from_pretrained(
        path, dtype=dtype, attn_implementation="eager", experts_implementation="eager"
    ).eval()


def compare_with_reference(path, dtype: torch.dtype, dtype_name: str, device: str = "cpu") -> tuple[float, ModelRunner]:
    """Greedy tokens must be identical at every step; returns the worst relative logit error."""
    # on a GPU the pools would otherwise take most of its memory
    max_total_tokens = 4096 if device == "cuda" else None
    runner = ModelRunner(
        ServerArgs(model_path=str(path), device=device, dtype=dtype_name, max_total_tokens=max_total_tokens)
    )
    reference = load_reference(path, dtype)
    prompts = random_prompts(runner.model_config.vocab_size)
    result = generate_greedy(runner, prompts, DECODE_STEPS)
    worst = 0.0
    for i, prompt in enumerate(prompts):
        ids = list(prompt)
        for step in range(DECODE_STEPS):
            with torch.no_grad():
                expected = reference(torch.tensor([ids])).logits[0, -1]
            worst = max(worst, relative_error(result.step_logits[step][i], expected))
            assert result.output_ids[i][step] == int(expected.argmax()), f"prompt {i} step {step}"
            ids.append(int(expected.argmax()))
    return worst, runner


def reference_float32_noise(path) -> float:
    """How far transformers' own float32 prefill logits are from its float64 ones."""
    ref32, ref64 = load_reference(path, torch.float32), load_reference(path, torch.float64)
    worst = 0.0
    for prompt in random_prompts(ref32.config.vocab_size):
        with torch.no_grad():
            exact = ref64(torch.tensor([prompt])).logits[0, -1]
            worst = max(worst, relative_error(ref32(torch.tensor([prompt])).logits[0, -1], exact))
    return worst


@pytest.mark.parametrize("variant", VARIANTS)
def test_greedy_tokens_and_logits_match_transformers_fp32(tiny_checkpoint, variant: str) -> None:
    path = tiny_checkpoint(variant)
    worst, runner = compare_with_reference(path, torch.float32, "float32")
    noise = reference_float32_noise(path)
    print(f"{variant} float32: max relative logit error {worst:.2e} (transformers fp32 vs fp64: {noise:.2e})")
    assert worst < max(FP32_REL_TOL, 2 * noise)
    allocator = runner.token_allocator
    allocator.check_integrity()
    assert allocator.full.available() == allocator.full_size
    assert allocator.swa.available() == allocator.swa_size


@pytest.mark.gpu
@pytest.mark.parametrize("variant", VARIANTS)
def test_gpu_paths_match_transformers_fp32(tiny_checkpoint, variant: str) -> None:
    """The GPU defaults (triton attention, fused kernels, CUDA-graph decode, MoE kernels) against transformers
    on the CPU. 1e-3: GPU kernels sum in other orders than the CPU reference, which moves float32 logits by
    more than the CPU-vs-CPU bound."""
    worst, runner = compare_with_reference(tiny_checkpoint(variant), torch.float32, "float32", device="cuda")
    print(f"{variant} float32 on GPU: max relative logit error {worst:.2e}")
    assert worst < 1e-3
    runner.token_allocator.check_integrity()


@pytest.mark.parametrize("variant", ["tiny-gemma-4-E4B-it", "tiny-gemma-4-26B-A4B-it"])
def test_bf16_prefill_logits_as_close_to_fp32_as_transformers_bf16(tiny_checkpoint, variant: str) -> None:
    """bf16 bound: srt's bf16 logits are at most twice as far from the float32 answer as transformers' bf16
    logits are (and within BF16_REL_TOL where that is looser)."""
    path = tiny_checkpoint(variant)
    runner = ModelRunner(ServerArgs(model_path=str(path), device="cpu", dtype="bfloat16"))
    ref16, ref32 = load_reference(path, torch.bfloat16), load_reference(path, torch.float32)
    prompts = random_prompts(runner.model_config.vocab_size, seed=2)
    result = generate_greedy(runner, prompts, 1)
    for i, prompt in enumerate(prompts):
        with torch.no_grad():
            exact = ref32(torch.tensor([prompt])).logits[0, -1]
            reference_error = relative_error(ref16(torch.tensor([prompt])).logits[0, -1], exact)
        error = relative_error(result.step_logits[0][i], exact)
        print(f"{variant} bf16 prompt {i}: srt {error:.2e}, transformers {reference_error:.2e} (vs fp32)")
        assert error < max(BF16_REL_TOL, 2 * reference_error)
