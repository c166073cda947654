"""Load testing for sgl-kvc's OpenAI-compatible server: locust users, a runner, reports.

    python -m loadtest.run --help
    locust -f loadtest/locustfile.py --host http://127.0.0.1:30000

Modules: `prompts` (seeded request generator), `locustfile` (streaming chat users that
record TTFT/TPOT/ITL as locust events), `metrics` (summary from locust's CSV and the
per-request CSV), `server` (start/stop a launcher process), `run` (orchestration),
`report` (markdown table and plot).
"""
