"""The hub's base: its errors (HubError and the HTTP status each carries), its config
(HubConfig) and count parsing. Imports no other room."""
