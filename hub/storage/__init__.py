"""Where the hub keeps things: the store contract (store.py) and its SQLite and PostgreSQL
stores, the one switch between them (backend.py), blobs (folder, S3, pack), migrations, the
audit log, tokens, the data lock, the database lease, model deltas, the hub's key."""
