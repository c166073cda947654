"""The compression moments: when a pass runs and what it keeps (`compressor` composes them:
`request_life`, `prefill`, `decode`, `scoring`, `commit`), how its compaction moves KV (`compaction`), RoPE."""
