"""The hub's domain: the ledger and its use cases (ledger/), job ingest (jobs.py), the
scheduler, the rounds, waits, the work signal, metrics. Knows no HTTP and no SQL."""
