"""The read model: everything owners, auditors and the console are shown, one module per view.

Queries only; nothing here changes state (that is the ledger's, hub/domain/ledger/). Each
function takes the store's connection (run through ``Store.query``, on the store's thread) or
the app, applies the reader's visibility rule, and returns plain JSON-ready documents. The API
routes, the console and so the CLI (which reads the API) show the same documents, so they cannot
disagree.

- access: who may read what (an owner its jobs, an auditor the evidence, an admin all)
- jobs: the job list, the status document, the console's job page and an auditor's review
- rounds: each closed round's history entry, the latest metrics, a round's shard map
- redaction: what a job's [privacy] option keeps from its owner
- models: a job's model versions and their .safetensors export
- flags: the flag list, one flag with its context, scores and headline, the audit queue
- evidence: a flag's scores against its thresholds, its headline, the referee's segments, the
  per-layer profile against the round's centre
- nodes: the node overview, assignments by state, a node's history
- plans: the pipeline plan a job would get on the nodes online now, from their offers
- audit: the audit log's verification, as the audit queue shows it
- figures: how a number is written for a reader
"""
