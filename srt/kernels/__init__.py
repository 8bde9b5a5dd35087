"""Triton kernels, one op per file, each beside its torch reference, each taking tensors (weights, eps).

Where a model op runs (the modules that call them are in `srt/layers/` and `srt/models/`):

    model op                                   kernel file                   reference
    RMSNorm (every norm)                       norm.py  rms_norm             rms_norm_reference
    residual add + norm (+ the next norm)      norm.py  add_rms_norm(...)    add_rms_norm_reference
    an MoE layer's end (parts, norms, add)     norm.py  moe_outputs_add_then_norm  (the references composed)
    RoPE cos/sin tables                        rope.py  rope_cos_sin         rope_cos_sin_reference
    q norm + RoPE (KV-shared layers)           rope.py  rms_norm_rope        rms_norm_rope_reference
    q/k/v norms + RoPE + K/V cache write       qkv_store.py                  qkv_norm_rope_store_reference
    MLP gelu(gate) * up                        gelu_mul.py                   gelu_tanh_mul_reference
    decode-sized projections (Hopper)          decode_gemm.py                F.linear (cuBLAS)
    decode-sized FP8 projections (2-32 rows)   decode_gemm_fp16.py           Fp8Linear.dequantized + F.linear
    ... one row (CUDA cores, weight-only)      decode_gemv_fp8.py            Fp8Linear.dequantized + F.linear
    ... where no float16 plan fits             decode_gemm_fp8.py            Fp8Linear.dequantized + F.linear
    ... W8A8 and the other swept variants      decode_gemm_fp8_variants.py   x rounded per row, K-step + F.linear
    FP8 activations (prefill, per token/group) fp8_quant.py                  quantize_fp8_reference
    block-scaled FP8 projections (prefill)     fp8_block_gemm.py             block_fp8_gemm_reference
    scaled token embedding                     embedding.py                  scaled_embedding_reference
    per-layer inputs of the model (PLE)        per_layer_inputs.py           combine_per_layer_inputs_reference
    per-layer-input block of a layer (PLE)     per_layer_projection.py       per_layer_input_projection_reference
    final logit softcap + greedy argmax        logits.py                     softcap_logits_reference
    paged attention: many rows per request     attention/extend.py           layers/attention/torch_native.py
    paged attention: one row per request       attention/decode.py           layers/attention/torch_native.py
    paged attention: a verify step's few rows  attention/verify.py           layers/attention/torch_native.py
    MoE top-k routing                          moe/routing.py                topk_routing_reference
    MoE slots sorted by expert (decode sizes)  moe/align.py                  layers/moe/fused_experts.py
    MoE grouped expert GEMMs                   moe/experts.py                Experts.forward_reference

Entry points take `use_triton`: None runs Triton on CUDA and the reference elsewhere; True forces Triton (on
the CPU only under Triton's interpreter, TRITON_INTERPRET=1, as the tests set it). `triton_support.py` is the
plumbing they share (no triton installed, the interpreter, chained launches). Tests mirror this folder in
test/kernels/.
"""
