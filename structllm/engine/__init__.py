"""The engine: scheduler, KV cache manager, model runner and sampler (imports torch)."""
