"""Statistics, Prometheus metrics and the compaction trace."""
