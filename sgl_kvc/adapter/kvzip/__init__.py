"""KVzip's reconstruction pass, run by SGLang inside the scheduler."""
