"""Admission and the scheduler's view of a request: footprints, chunk pressure, the request guard."""
