"""Per-request failures, planted faults for tests, invariants, tensor-parallel votes, start-up refusals."""
