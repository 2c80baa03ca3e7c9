"""`heron route`: a torch-free, cache-aware OpenAI gateway in front of `heron serve` workers.

Layout: ``config`` (every flag), ``workers`` (what is known of each worker), ``breaker``,
``health`` (active checks and scrapes), ``admission`` (the router's own limit and global
saturation), ``guards`` (input limits), ``ingress`` (the forwarding routes as plain ASGI),
``asgi`` (disconnect watching), ``proxy`` (worker choice, forwarding, retries until
committed), ``relay`` (a committed response streamed through), ``upstream`` (the one HTTP
client toward the workers), ``metrics``, ``policies`` (who gets a request), ``app`` (the
FastAPI app), ``cli`` and ``launch`` (local workers).
Nothing here imports torch or transformers.
"""
