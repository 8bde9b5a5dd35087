"""The inputs of one forward pass: `ForwardBatch` (the one flat batch layout every model path reads) and the
host <-> device copies that build it without waiting for the device. Below `layers/` and `models/`, which
read it, and above `mem_cache/`, whose pools it carries."""
