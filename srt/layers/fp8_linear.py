"""FP8 projections (#26): float8_e4m3fn weights kept in FP8 with float32 scales, and the GEMMs that read them.

Storage (`Fp8Linear`):

    weight        [N, K] float8_e4m3fn, row-major (K-major): `torch._scaled_mm` takes weight.t() as its column-major
                  second operand, and the chained decode GEMM loads [BLOCK_N, BLOCK_K] tiles of it by TMA
    weight_scale  [N, 1] float32 per output channel ("channel": fp8-dynamic checkpoints, `--quantization fp8`), or
                  [N, ceil(K / block_k)] for block-scaled checkpoints: each 128 x 128 tile's scale repeated over
                  the tile's rows, so projections stack along N (q/k/v, gate/up) for any N, 128-multiple or not

    w[n, k] = weight[n, k] * weight_scale[n, k // block_k]   (block_k = K for per-channel scales)

GEMMs (`fp8_linear`, what `Fp8Linear.forward` runs; `layers/linear.py` sends decode sizes to the chained GEMM):

- decode (<= 32 rows, Hopper): chained Triton GEMMs read the FP8 tiles, widen them to float16 (the activations
  too, saturated at 65504) and apply the scales (per output column in the epilogue, per K-block inside the loop),
  weight-only: half the bytes of a bf16 weight, which is what a memory-bound decode step pays for
  (`kernels/decode_gemm_fp16.py`; one row: `kernels/decode_gemv_fp8.py`);
- larger on CUDA, per-channel: activations quantized per token (dynamic, absmax / 448; `kernels/fp8_quant.py`),
  then `torch._scaled_mm` with row-wise scales (FP8 tensor cores);
- larger on CUDA, block-scaled: activations quantized per token and 128-column group, then a Triton GEMM on FP8
  tensor cores that applies both scales per K-block (`kernels/fp8_block_gemm.py`, untuned);
- elsewhere (CPU, the reference): the weight dequantized to the activation dtype, then the plain product. With
  `emulate_activations` set, the activations go through the same FP8 quantization the GPU path (and the
  checkpoint's config) uses: per token, or per token and 128-column group for block checkpoints (the test of the
  W8A8 error against 16 bits).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from srt.kernels.fp8_block_gemm import block_fp8_gemm
from srt.kernels.fp8_quant import FP8, quantize_fp8, quantize_fp8_reference
from srt.kernels.triton_support import has_fp8_tensor_cores


class Fp8Linear(nn.Module):
    """A bias-free projection y = x @ w^T whose weight stays in FP8 (layout in the module docstring).

    `block`: (rows, cols) of the checkpoint's weight tiles, None for per-channel scales."""

    def __init__(
        self,
        in_features: int,
        out_features: int,
        block: tuple[int, int] | None = None,
        device: torch.device | str | None = None,
    ) -> None:
        super().__init__()
        self.in_features, self.out_features, self.block = in_features, out_features, block
        cols = 1 if block is None else -(-in_features // block[1])
        self.weight = nn.Parameter(torch.empty(out_features, in_features, dtype=FP8, device=device), False)
        self.weight_scale = nn.Parameter(torch.empty(out_features, cols, dtype=torch.float32, device=device), False)
        self.emulate_activations = False  # the CPU reference's W8A8 numerics (see the module docstring)

    @property
    def block_k(self) -> int:
        """Columns that share a scale: the block's width, or every column for per-channel scales."""
        return self.in_features if self.block is None else self.block[1]

    def extra_repr(self) -> str:
        scales = "per channel" if self.block is None else f"{self.block[0]}x{self.block[1]} blocks"
        return f"in_features={self.in_features}, out_features={self.out_features}, float8_e4m3fn, {scales}"

    @classmethod
    @torch.no_grad()
    def quantized(cls, linear: nn.Linear) -> Fp8Linear:
        """`linear`'s weight quantized per output channel (absmax / 448), on its device (`--quantization fp8`)."""
        weight = linear.weight
        out = cls(weight.shape[1], weight.shape[0], device="meta")
        q, scale = quantize_fp8(weight)  # a row's absmax / 448, as for a token's activations
        out.weight = nn.Parameter(q.contiguous(), False)  # row-major whatever the 16-bit layout was
        out.weight_scale = nn.Parameter(scale, False)
        return out

    def scale_from_checkpoint(self, scale: torch.Tensor) -> torch.Tensor:
        """A checkpoint's `weight_scale` ([N, 1] or [N] per channel, [ceil(N/128), ceil(K/128)] per block) in
        this module's row form."""
        if self.block is None:
            return scale.float().reshape(-1, 1)
        return scale.float().repeat_interleave(self.block[0], dim=0)[: self.out_features]

    def dequantized(self, dtype: torch.dtype) -> torch.Tensor:
        """The [N, K] weight weight * scale in `dtype` (rounded once, from float32)."""
        if self.block is None:
            return (self.weight.float() * self.weight_scale).to(dtype)
        n, k = self.weight.shape
        blocks, width = self.weight_scale.shape[1], self.block_k
        weight = F.pad(self.weight.float(), (0, blocks * width - k)).view(n, blocks, width)
        return (weight * self.weight_scale[:, :, None]).view(n, blocks * width)[:, :k].to(dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return fp8_linear(x, self)


@torch.no_grad()
def stack_fp8(*linears: Fp8Linear) -> Fp8Linear:
    """One Fp8Linear whose output is the given ones' outputs side by side (weights and scales joined along N)."""
    blocks = {linear.block for linear in linears}
    ins = {linear.in_features for linear in linears}
    if len(blocks) != 1 or len(ins) != 1:
        raise ValueError(f"cannot stack FP8 projections with different blocks {blocks} or inputs {ins}")
    stacked = Fp8Linear(ins.pop(), sum(linear.out_features for linear in linears), blocks.pop(), device="meta")
    stacked.weight = nn.Parameter(torch.cat([linear.weight for linear in linears]), False)
    stacked.weight_scale = nn.Parameter(torch.cat([linear.weight_scale for linear in linears]), False)
    return stacked


def dequantize_activations(q: torch.Tensor, scale: torch.Tensor, group: int | None = None) -> torch.Tensor:
    """float32 q * scale of `quantize_fp8(x, group)`'s output (`kernels/fp8_quant.py`)."""
    if group is None:
        return q.float() * scale
    return q.float() * scale.repeat_interleave(group, dim=1)[:, : q.shape[1]]


def scaled_mm_applies(x: torch.Tensor, layer: Fp8Linear) -> bool:
    """Whether `fp8_linear` runs torch._scaled_mm: CUDA with FP8 tensor cores (Ada, Hopper and later), bf16
    activations, per-channel scales, K and N multiples of 16."""
    return (
        x.is_cuda
        and layer.block is None
        and x.dtype == torch.bfloat16
        and has_fp8_tensor_cores(x.device)
        and layer.in_features % 16 == 0
        and layer.out_features % 16 == 0
    )


def block_gemm_applies(x: torch.Tensor, layer: Fp8Linear) -> bool:
    """Whether `fp8_linear` runs the block-scaled Triton GEMM: CUDA with FP8 tensor cores, 16-bit activations,
    block scales whose width (the activations' group) is a power of two >= 16."""
    width = layer.block_k
    return (
        x.is_cuda
        and layer.block is not None
        and x.dtype in (torch.bfloat16, torch.float16)
        and has_fp8_tensor_cores(x.device)
        and width >= 16
        and width & (width - 1) == 0
    )


def fp8_linear(x: torch.Tensor, layer: Fp8Linear) -> torch.Tensor:
    """x @ w^T in x's dtype for x [T, K] (the routes of the module docstring, decode aside)."""
    if block_gemm_applies(x, layer):
        xq, x_scale = quantize_fp8(x, layer.block_k)
        return block_fp8_gemm(xq, x_scale, layer.weight, layer.weight_scale, layer.block_k, x.dtype)
    if scaled_mm_applies(x, layer):
        xq, x_scale = quantize_fp8(x)
        return torch._scaled_mm(
            xq, layer.weight.t(), scale_a=x_scale, scale_b=layer.weight_scale.view(1, -1), out_dtype=x.dtype
        )
    if layer.emulate_activations:
        group = None if layer.block is None else layer.block_k
        xq = dequantize_activations(*quantize_fp8_reference(x, group), group)
        return F.linear(xq, layer.dequantized(torch.float32)).to(x.dtype)
    return F.linear(x, layer.dequantized(x.dtype))
