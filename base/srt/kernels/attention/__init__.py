"""Triton kernels of the `triton` attention backend: paged KV read through req_to_token (and full_to_swa).

- `paged_kv.py`: the shared per-row KV bounds and the slot double indirection, as `@triton.jit` helpers.
- `extend_attention.py`: many query rows per request (prefill, prefix hits, chunks, YOCO row subsets).
- `decode_attention.py`: one query row per request, split-KV (flash decoding) plus a combine pass.
"""
