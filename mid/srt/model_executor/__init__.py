"""Running the model: the batch it sees (ForwardBatch), the runner that owns weights and KV pools."""
