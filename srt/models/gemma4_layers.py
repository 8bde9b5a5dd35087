"""The building blocks of a Gemma 4 decoder: attention, MLP, decoder layer, residual add + norm.

Parameter names are the checkpoint's (`Gemma4ForCausalLM` in models/gemma4.py assembles the model). After
loading, `fuse_projections` stacks projections that read the same input and stores every projection weight
transposed; at decode sizes the q/qkv, o and down projections return K-split partial sums that the norm
kernel after them sums (`layers/linear.py`). The projections may be `Fp8Linear`s (FP8 checkpoints, or
`quantize_fp8` after fusing for `--quantization fp8`); the seam's functions run either kind.
"""

from __future__ import annotations

import torch
from torch import nn

from srt import envs
from srt.configs.model_config import AttentionLayerSpec, ModelConfig
from srt.distributed.collectives import reduce_sum
from srt.forward.forward_batch import ForwardBatch
from srt.kernels.norm import (
    MoeNorms,
    ThenAdd,
    add_rms_norm,
    add_rms_norm_then_moe_norms,
    add_rms_norm_then_norm,
    moe_outputs_add_then_norm,
)
from srt.kernels.per_layer_projection import per_layer_input_projection
from srt.kernels.qkv_store import QKVLayout, qkv_norm_rope_store
from srt.kernels.rope import rms_norm_rope
from srt.layers.attention.base import AttentionBackend
from srt.layers.fp8_linear import Fp8Linear
from srt.layers.layernorm import RMSNorm
from srt.layers.linear import gelu_mlp, linear_partials, project, stack_linears, store_transposed
from srt.layers.moe.experts import Experts
from srt.layers.moe.router import Router
from srt.mem_cache.allocator import debug_kv_indices


class Gemma4Attention(nn.Module):
    """q/k/v projections with q/k/v norms and RoPE; scaling 1.0. KV-shared layers have only q and o.

    Weights load into the checkpoint's q_proj / k_proj / v_proj; `fuse_projections` then stacks them into
    `qkv_proj` (q and k only on k_eq_v layers), the form `forward` runs. Under tensor parallelism `spec` holds
    this rank's heads and the o projection's output is summed over the ranks.
    """

    def __init__(self, spec: AttentionLayerSpec, hidden_size: int, eps: float, tp_size: int = 1) -> None:
        super().__init__()
        self.spec = spec
        self.tp_size = tp_size
        dim, heads, kv_heads = spec.head_dim, spec.num_heads, spec.num_kv_heads
        self.q_proj = nn.Linear(hidden_size, heads * dim, bias=False)
        self.q_norm = RMSNorm(dim, eps=eps)
        self.qkv_proj: nn.Linear | Fp8Linear | None = None
        if spec.owns_kv:
            self.k_proj = nn.Linear(hidden_size, kv_heads * dim, bias=False)
            # k_eq_v layers (full layers of 26B/31B) take V from the K projection before its norm and RoPE
            self.v_proj = None if spec.k_eq_v else nn.Linear(hidden_size, kv_heads * dim, bias=False)
            self.k_norm = RMSNorm(dim, eps=eps)
            self.layout = QKVLayout(heads, kv_heads, dim, spec.k_eq_v)
        self.o_proj = nn.Linear(heads * dim, hidden_size, bias=False)

    def fuse_projections(self) -> None:
        if self.spec.owns_kv and self.qkv_proj is None:
            self.qkv_proj = stack_linears(*(p for p in (self.q_proj, self.k_proj, self.v_proj) if p is not None))
            del self.q_proj, self.k_proj, self.v_proj
        elif not self.spec.owns_kv:
            store_transposed(self.q_proj)
        store_transposed(self.o_proj)

    def quantize_fp8(self) -> None:
        """Every projection (after `fuse_projections`) in FP8 per output channel; FP8 ones stay as they are."""
        for name in ("qkv_proj" if self.spec.owns_kv else "q_proj", "o_proj"):
            setattr(self, name, _quantized(getattr(self, name)))

    def forward(
        self,
        hidden: torch.Tensor,
        cos_sin: tuple[torch.Tensor, torch.Tensor],
        batch: ForwardBatch,
        backend: AttentionBackend,
    ) -> torch.Tensor:
        tokens, dim = hidden.shape[0], self.spec.head_dim
        cos, sin = cos_sin
        if not self.spec.owns_kv:
            q = rms_norm_rope(
                project(hidden, self.q_proj).unflatten(-1, (-1, dim)), self.q_norm.weight, cos, sin, self.q_norm.eps
            )
        elif self.qkv_proj is None:
            raise RuntimeError("Gemma4Attention runs after fuse_projections() (load_model calls it)")
        else:  # norms, RoPE and the K/V cache write in one kernel on GPU; the attention then reads the cache only
            target = batch.kv_pool.cache_target(self.spec.layer_id)
            if debug_kv_indices():
                target.rows(batch.out_cache_loc)  # checks every row: the kernel trusts them
            q = qkv_norm_rope_store(
                project(hidden, self.qkv_proj),
                self.layout,
                self.q_norm.weight,
                self.k_norm.weight,
                self.q_norm.eps,
                cos,
                sin,
                target.k_buffer,
                target.v_buffer,
                target.full_to_swa,
                batch.out_cache_loc,
                k_scale=target.scales.k,
                v_scale=target.scales.v,
            )
        out = backend.forward(q, self.spec, batch)
        return reduce_sum(linear_partials(out.reshape(tokens, -1), self.o_proj), self.tp_size)


class Gemma4MLP(nn.Module):
    """gelu-tanh gated MLP; `fuse_projections` stacks the checkpoint's gate_proj and up_proj into gate_up_proj.
    Under tensor parallelism `intermediate_size` is this rank's share and the output is summed over the ranks."""

    def __init__(self, hidden_size: int, intermediate_size: int, tp_size: int = 1) -> None:
        super().__init__()
        self.tp_size = tp_size
        self.gate_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.up_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=False)
        self.gate_up_proj: nn.Linear | Fp8Linear | None = None

    def fuse_projections(self) -> None:
        if self.gate_up_proj is None:
            self.gate_up_proj = stack_linears(self.gate_proj, self.up_proj)
            del self.gate_proj, self.up_proj
        store_transposed(self.down_proj)

    def quantize_fp8(self) -> None:
        """gate_up and down (after `fuse_projections`) in FP8 per output channel; FP8 ones stay as they are."""
        self.gate_up_proj, self.down_proj = _quantized(self.gate_up_proj), _quantized(self.down_proj)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.gate_up_proj is None:
            raise RuntimeError("Gemma4MLP runs after fuse_projections() (load_model calls it)")
        return reduce_sum(linear_partials(gelu_mlp(x, self.gate_up_proj), self.down_proj), self.tp_size)


class Gemma4DecoderLayer(nn.Module):
    """Attention, dense MLP (+ MoE block on 26B-A4B), per-layer input, layer scalar."""

    def __init__(self, config: ModelConfig, spec: AttentionLayerSpec) -> None:
        super().__init__()
        hf = config.hf_text_config
        hidden, eps = hf.hidden_size, hf.rms_norm_eps
        self.tp_size = config.tp_size
        self.self_attn = Gemma4Attention(spec, hidden, eps, config.tp_size)
        # KV-shared layers of double-wide checkpoints (E2B) have twice the MLP width
        double_wide = bool(hf.use_double_wide_mlp) and not spec.owns_kv
        self.mlp = Gemma4MLP(hidden, config.tp_part(hf.intermediate_size * (2 if double_wide else 1)), config.tp_size)
        self.input_layernorm = RMSNorm(hidden, eps)
        self.post_attention_layernorm = RMSNorm(hidden, eps)
        self.pre_feedforward_layernorm = RMSNorm(hidden, eps)
        self.post_feedforward_layernorm = RMSNorm(hidden, eps)
        self.register_buffer("layer_scalar", torch.ones(1))
        self.has_moe = config.is_moe
        if self.has_moe:
            self.router = Router(hidden, hf.num_experts, hf.top_k_experts, eps)
            # each rank holds every expert's slice of the intermediate width; the routing is the same on all
            self.experts = Experts(hf.num_experts, hidden, config.tp_part(hf.moe_intermediate_size))
            self.post_feedforward_layernorm_1 = RMSNorm(hidden, eps)
            self.post_feedforward_layernorm_2 = RMSNorm(hidden, eps)
            self.pre_feedforward_layernorm_2 = RMSNorm(hidden, eps)
        self.ple_dim = hf.hidden_size_per_layer_input or 0
        if self.ple_dim:
            self.per_layer_input_gate = nn.Linear(hidden, self.ple_dim, bias=False)
            self.per_layer_projection = nn.Linear(self.ple_dim, hidden, bias=False)
            self.post_per_layer_input_norm = RMSNorm(hidden, eps)

    def forward(
        self,
        hidden: torch.Tensor,
        attn_input: torch.Tensor,
        per_layer_input: torch.Tensor | None,
        cos_sin: tuple[torch.Tensor, torch.Tensor],
        batch: ForwardBatch,
        backend: AttentionBackend,
        next_norm: RMSNorm | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(new hidden, next_norm(new hidden) or None). `attn_input` is input_layernorm(hidden): the layer
        before computes it in the kernel of its last residual add, as this one does for `next_norm`. The
        attention and MLP outputs may come as K-split partial sums (`layers/linear.py`): the add + norm
        kernels after them take either form."""
        attn = self.self_attn(attn_input, cos_sin, batch, backend)
        if self.has_moe:
            # the router and the experts see the residual stream, not the dense MLP's input norm: their norms of
            # it come from the residual add's kernel too
            hidden, mlp_input, expert_input, router_input = add_rms_norm_then_moe_norms(
                attn, hidden, self.post_attention_layernorm.scale, self.post_attention_layernorm.eps,
                self.pre_feedforward_layernorm.weight, self.pre_feedforward_layernorm.eps,
                MoeNorms(self.pre_feedforward_layernorm_2.weight, *self.router.input_norms()),
            )  # fmt: skip
        else:
            hidden, mlp_input = add_norm_then_norm(
                self.post_attention_layernorm, attn, hidden, self.pre_feedforward_layernorm
            )

        residual = hidden
        if self.has_moe:
            mlp_out, expert_terms = self._dense_beside_experts(mlp_input, expert_input, router_input)
            if self.tp_size > 1:
                expert_terms = reduce_sum(expert_terms, self.tp_size).unsqueeze(1)
            # the parts' two norms, their sum, its norm and the residual add in one kernel (with the layer scalar
            # and the next input norm unless a per-layer input comes after it)
            norm_1, norm_2 = self.post_feedforward_layernorm_1, self.post_feedforward_layernorm_2
            post = self.post_feedforward_layernorm
            last = not self.ple_dim and next_norm is not None
            hidden, normed = moe_outputs_add_then_norm(
                mlp_out, norm_1.weight, norm_1.eps, expert_terms, norm_2.weight, norm_2.eps,
                ThenAdd(residual, post.weight, post.eps), next_norm.weight if last else None,
                next_norm.eps if last else 0.0, None if self.ple_dim else self.layer_scalar,
            )  # fmt: skip
            if not self.ple_dim:
                return hidden, normed
        else:
            mlp_out = self.mlp(mlp_input)
            if not self.ple_dim:
                return add_norm_then_norm(
                    self.post_feedforward_layernorm, mlp_out, residual, next_norm, self.layer_scalar
                )
            # the layer scalar multiplies the layer's last sum: the per-layer-input one here
            hidden = add_norm(self.post_feedforward_layernorm, mlp_out, residual)
        # gate GEMV, gelu * per-layer input, projection GEMV: two split-K kernels at decode sizes on GPU
        projected = per_layer_input_projection(
            hidden, per_layer_input, self.per_layer_input_gate.weight, self.per_layer_projection.weight
        )
        return add_norm_then_norm(self.post_per_layer_input_norm, projected, hidden, next_norm, self.layer_scalar)

    def _dense_beside_experts(
        self, mlp_input: torch.Tensor, expert_input: torch.Tensor, router_input: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(the dense MLP's output, the expert terms unsummed: the add + norms kernel after them sums and norms
        them). Both read norms of the same residual stream and meet only in that kernel, so on CUDA the dense MLP's
        two small GEMMs run on a side stream while the router and the experts run: 26B-A4B's dense MLP took 22 us
        of a 346 us FP8 layer at 32 rows, latency more than bytes (its weights ~18 MB, the experts' ~670 MB).
        Not under tensor parallelism (two all-reduces at once on one communicator) or SRT_MOE_SIDE_STREAM=0."""
        route = self.router.route
        side = _side_stream(mlp_input.device) if self.tp_size == 1 and MOE_SIDE_STREAM else None
        if side is None:
            mlp_out = self.mlp(mlp_input)
            return mlp_out, self.experts(expert_input, *route(router_input), combine=self.tp_size > 1)
        main = torch.cuda.current_stream(mlp_input.device)
        side.wait_stream(main)  # the inputs are written
        with torch.cuda.stream(side):
            mlp_out = self.mlp(mlp_input)
        expert_terms = self.experts(expert_input, *route(router_input), combine=False)
        # the inputs stay referenced until here, so the main stream reuses their memory only after the side's reads
        main.wait_stream(side)
        return mlp_out, expert_terms


MOE_SIDE_STREAM = envs.SRT_MOE_SIDE_STREAM.enabled()
_SIDE_STREAMS: dict[torch.device, torch.cuda.Stream] = {}


def _side_stream(device: torch.device) -> torch.cuda.Stream | None:
    """The device's side stream (CUDA only), made once: CUDA graphs captured over it replay its work."""
    if device.type != "cuda":
        return None
    if device not in _SIDE_STREAMS:
        _SIDE_STREAMS[device] = torch.cuda.Stream(device)
    return _SIDE_STREAMS[device]


def _quantized(linear: nn.Linear | Fp8Linear | None) -> Fp8Linear:
    if linear is None:
        raise RuntimeError("quantize_fp8 runs after fuse_projections() (load_model calls both)")
    return linear if isinstance(linear, Fp8Linear) else Fp8Linear.quantized(linear)


def add_norm(norm: RMSNorm, x: torch.Tensor, residual: torch.Tensor, scale: torch.Tensor | None = None) -> torch.Tensor:
    """(residual + norm(x)) * scale in one fused kernel on GPU."""
    return add_rms_norm(x, residual, norm.scale, norm.eps, scale)


def add_norm_then_norm(
    norm: RMSNorm,
    x: torch.Tensor,
    residual: torch.Tensor,
    next_norm: RMSNorm | None,
    scale: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(summed, next_norm(summed)) with summed = (residual + norm(x)) * scale, in one fused kernel on GPU;
    (summed, None) without a next norm."""
    if next_norm is None:
        return add_norm(norm, x, residual, scale), None
    return add_rms_norm_then_norm(x, residual, norm.scale, norm.eps, next_norm.weight, next_norm.eps, scale)
