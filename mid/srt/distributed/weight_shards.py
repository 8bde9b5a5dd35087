"""Which part of each checkpoint tensor a tensor-parallel rank loads, read straight from the safetensors file
(`safe_open(...).get_slice`: each rank reads only its rows or columns, never the whole tensor).

    q_proj, gate_proj, up_proj          [out, in]   this rank's rows (its heads / its MLP columns)
    k_proj, v_proj                      [out, in]   the rows of this rank's KV heads (`kv_heads_of_rank`)
    o_proj, down_proj                   [out, in]   this rank's columns (row-parallel: outputs summed)
    experts.gate_up_proj                [E, 2I, H]  this rank's gate rows and its up rows, each expert
    experts.down_proj                   [E, H, I]   this rank's columns, each expert
    embed_tokens, embed_tokens_per_layer, lm_head   this rank's vocabulary rows (the last rank's padded);
                                        an MTP assistant's table (its LM head) whole
    everything else (norms, router, per-layer gate/projection, vision tower)   whole, on every rank

An FP8 weight's scale follows its weight (`shard_row_scale`): the rows of a row shard, the K blocks of a
column shard; per-channel scales of a column shard stay whole.
"""

from __future__ import annotations

from typing import NamedTuple, Protocol

import torch

from srt.configs.assistant_config import ASSISTANT_MODEL_TYPE
from srt.configs.model_config import ModelConfig, kv_heads_of_rank

_COLUMN = ("self_attn.q_proj.weight", "mlp.gate_proj.weight", "mlp.up_proj.weight")
_KV = ("self_attn.k_proj.weight", "self_attn.v_proj.weight")
_ROW = ("self_attn.o_proj.weight", "mlp.down_proj.weight")
_VOCAB = ("model.embed_tokens.weight", "model.embed_tokens_per_layer.weight", "lm_head.weight")


class TensorSlice(Protocol):
    """What safetensors' `get_slice` returns: a shape and indexing that reads only the indexed part."""

    def get_shape(self) -> list[int]: ...

    def __getitem__(self, index: tuple[slice, ...]) -> torch.Tensor: ...


class Shard(NamedTuple):
    """Pieces of the checkpoint tensor along `dim`, concatenated in order; padded with zeros to `size` rows."""

    dim: int
    pieces: tuple[range, ...]
    size: int


def shard_of(param: str, shape: list[int], config: ModelConfig) -> Shard | None:
    """This rank's part of the checkpoint tensor that loads into parameter `param`; None: all of it."""
    rank, size = config.tp_rank, config.tp_size
    if size == 1 or not (param.startswith("model.") or param.startswith("lm_head")):
        return None  # the vision tower and embedder (`vision_tower.*`, `embed_vision.*`) are replicated
    if param in _VOCAB and config.model_type != ASSISTANT_MODEL_TYPE:  # an assistant's table stays whole
        rows = config.vocab_part(shape[0])
        return Shard(0, (range(rank * rows, min((rank + 1) * rows, shape[0])),), rows)
    if param.endswith(_COLUMN):
        return _even(0, shape[0], rank, size)
    if param.endswith(_ROW):
        return _even(1, shape[1], rank, size)
    if param.endswith(_KV):
        layer = int(param.split(".layers.")[1].split(".")[0])
        head_dim = config.layers[layer].head_dim
        heads = kv_heads_of_rank(shape[0] // head_dim, rank, size)
        piece = range(heads.start * head_dim, heads.stop * head_dim)
        return Shard(0, (piece,), len(piece))
    if param.endswith("experts.gate_up_proj"):
        inter = shape[1] // 2
        part = _even(1, inter, rank, size).pieces[0]
        pieces = (part, range(inter + part.start, inter + part.stop))
        return Shard(1, pieces, 2 * len(part))
    if param.endswith("experts.down_proj"):
        return _even(2, shape[2], rank, size)
    return None


def read_shard(tensor: TensorSlice, shard: Shard | None) -> torch.Tensor:
    """The tensor (or this rank's part of it), reading only that part from the file."""
    if shard is None:
        return tensor[:]
    lead = (slice(None),) * shard.dim
    parts = [tensor[(*lead, slice(piece.start, piece.stop))] for piece in shard.pieces]
    out = torch.cat(parts, dim=shard.dim) if len(parts) > 1 else parts[0]
    missing = shard.size - out.shape[shard.dim]
    if missing:  # the last rank's vocabulary rows past the end: no id selects them
        pad = list(out.shape)
        pad[shard.dim] = missing
        out = torch.cat([out, out.new_zeros(pad)], dim=shard.dim)
    return out


def shard_row_scale(
    scale: torch.Tensor, shard: Shard | None, out_features: int, block: tuple[int, int] | None
) -> torch.Tensor:
    """This rank's part of an FP8 weight's checkpoint scale ([N, 1] per channel, [ceil(N/bo), ceil(K/bk)] per
    block), in `Fp8Linear`'s row form: [rows, 1], or [rows, ceil(K/bk)] with each block row repeated over its
    rows (so a shard of rows may start inside a block). `out_features`: the whole weight's N. A shard of K must
    start and end on block boundaries (ValueError otherwise)."""
    if block is None:
        rows = scale.float().reshape(-1, 1)
    else:
        rows = scale.float().repeat_interleave(block[0], dim=0)[:out_features]
    if shard is None:
        return rows
    if shard.dim == 0:
        return torch.cat([rows[piece.start : piece.stop] for piece in shard.pieces])
    if block is None:
        return rows  # per-channel scales belong to output rows, which a K shard keeps whole
    width = block[1]
    if any(piece.start % width for piece in shard.pieces):
        raise ValueError(
            f"a {shard.size}-column tensor-parallel shard of a block-scaled FP8 weight does not start on its "
            f"{width}-column scale blocks; use a --tp-size that splits K into multiples of {width}"
        )
    return torch.cat([rows[:, piece.start // width : -(-piece.stop // width)] for piece in shard.pieces], dim=1)


def _even(dim: int, length: int, rank: int, size: int) -> Shard:
    if length % size:
        raise ValueError(f"--tp-size {size} does not divide a checkpoint dimension of {length}")
    part = length // size
    return Shard(dim, (range(rank * part, (rank + 1) * part),), part)
