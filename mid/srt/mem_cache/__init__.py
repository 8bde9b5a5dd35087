"""KV memory: request -> token slot table, slot allocators, per-layer KV pools, prefix caches."""
