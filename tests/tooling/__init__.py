"""Test tooling shared by tests and benches (attack catalogue)."""
