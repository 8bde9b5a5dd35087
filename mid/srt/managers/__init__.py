"""Request management: the scheduler (batching, caching, sampling) and, later, the tokenizer/detokenizer."""
