"""Tensor parallelism over torch.distributed: rank processes, collectives, weight shards."""
