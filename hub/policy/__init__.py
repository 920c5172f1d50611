"""Decisions and checks that hold no state of their own and reach no network and no database:
verification and reputation, aggregation, the referee, the round policy (round_policy.py),
privacy, evaluation, downlink encoding, admission, progress and backoff, secure aggregation's
round, the owner's data checks and defaults. Imports base only."""
