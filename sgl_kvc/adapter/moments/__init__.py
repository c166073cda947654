"""The compression moments: when a pass runs (compressor), how its compaction moves KV (compaction), RoPE."""
