"""The hub over HTTP: the aiohttp app (app.py), its routes and wire format, the edge guards, the
workers of `serve --workers N`, the read model, the web console (console/)."""
