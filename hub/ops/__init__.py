"""Operating the hub: the `gpuflex-hub` CLI (cli.py and its plugins), the demo, the local
cluster, the owner's HTTP client."""
