"""GPUFlex hub package.

The hub is seven rooms, bottom first; each imports only the rooms below it (tests/test_layering.py):

- ``base``: errors (HubError and its HTTP statuses), ``HubConfig``, count parsing.
- ``policy``: decisions and checks that reach no network and no database: verification and
  reputation, aggregation, the referee, the round policy (round_policy.py), privacy, evaluation,
  downlink, admission, progress, secure aggregation's round, the data checks and defaults.
- ``model``: the plain state types the hub shares: jobs, shards, assignments, updates (job.py)
  and nodes (node.py).
- ``storage``: the store contract (store.py), its SQLite and PostgreSQL stores, the one switch
  between them (backend.py), blobs (folder, S3, pack), migrations, the audit log, tokens, the
  data lock, the database lease, model deltas, the hub's key.
- ``domain``: the ledger and its use cases (ledger/), job ingest, the scheduler, the rounds,
  waits, the work signal, metrics.
- ``server``: the aiohttp app, its routes and wire, the workers, the read model, the web console
  (console/).
- ``ops``: the ``gpuflex-hub`` CLI, the demo, the local cluster, the owner's client.

``python -m gpuflex.hub`` (``__main__``) is ``gpuflex-hub``.
"""
