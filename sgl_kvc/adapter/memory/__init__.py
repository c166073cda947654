"""KV memory: the reservation beside SGLang's pools, the FP8 pool and the unit pool."""
