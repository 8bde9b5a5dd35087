"""How a prefill step's projection GEMMs cost with the step's row count (cuBLAS picks its kernel by shape).

    python bench/prefill_gemm_rows.py [--model gemma-4-E4B-it] [--rows 8192 8199 8218 8256] [--kv-shared-rows 0]

Times, with CUDA events, each dense projection of the model's KV-owning layers (stacked qkv, o, stacked gate_up,
down, as `layers/linear.py` runs them: x @ W^T on a row-major W^T) at each row count, and prints the sum over one
step's layers. YOCO runs the KV-shared layers on the logits rows alone, so they are left out. A step with 8192
prompt tokens and 26 decoding requests has 8218 rows: this says what those 26 rows cost in the GEMMs (#22).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
import torch.nn.functional as F

VARIANTS = Path(__file__).resolve().parents[1] / "srt" / "configs" / "gemma4_variants.json"


def projections(text: dict) -> list[tuple[str, int, int, int]]:
    """(name, K, N, layers) of the KV-owning layers' projections."""
    owning = text["layer_types"][: text["num_hidden_layers"] - text.get("num_kv_shared_layers", 0)]
    hidden, heads = text["hidden_size"], text["num_attention_heads"]
    out = []
    full_kv_heads = text.get("num_global_key_value_heads", text["num_key_value_heads"])
    for kind, dim, kv_heads in (
        ("sliding_attention", text["head_dim"], text["num_key_value_heads"]),
        ("full_attention", text["global_head_dim"], full_kv_heads),
    ):
        count = owning.count(kind)
        kv = 1 if text.get("attention_k_eq_v") and kind == "full_attention" else 2
        out.append((f"{kind[:4]} qkv", hidden, (heads + kv * kv_heads) * dim, count))
        out.append((f"{kind[:4]} o", heads * dim, hidden, count))
    inter = text["intermediate_size"]
    return out + [("gate_up", hidden, 2 * inter, len(owning)), ("down", inter, hidden, len(owning))]


def time_ms(x: torch.Tensor, weight: torch.Tensor, repeat: int) -> float:
    for _ in range(3):
        F.linear(x, weight)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(repeat):
        F.linear(x, weight)
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / repeat


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="gemma-4-E4B-it")
    parser.add_argument("--rows", type=int, nargs="+", default=[8166, 8192, 8199, 8218, 8224, 8256, 8320])
    parser.add_argument("--repeat", type=int, default=20)
    args = parser.parse_args()
    text = json.loads(VARIANTS.read_text())[args.model]["text"]
    shapes = projections(text)
    weights = {name: torch.randn(k, n, device="cuda", dtype=torch.bfloat16).t() for name, k, n, _ in shapes}
    print(f"{'rows':>6} " + " ".join(f"{name:>10}" for name, *_ in shapes) + "   step ms")
    for rows in args.rows:
        per = [time_ms(torch.randn(rows, k, device="cuda", dtype=torch.bfloat16), weights[name], args.repeat)
               for name, k, _, _ in shapes]  # fmt: skip
        step = sum(ms * layers for ms, (_, _, _, layers) in zip(per, shapes, strict=True))
        print(f"{rows:>6} " + " ".join(f"{ms:>10.3f}" for ms in per) + f"   {step:7.2f}")


if __name__ == "__main__":
    main()
