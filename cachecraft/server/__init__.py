"""``cachecraft serve``: an OpenAI-compatible HTTP server whose memory tiers live as long as it does.

- :mod:`~cachecraft.server.schemas`: the request bodies;
- :mod:`~cachecraft.server.service`: the pipeline, loaded once, and the queue in front of it;
- :mod:`~cachecraft.server.streaming`: answer text on its way to the client;
- :mod:`~cachecraft.server.metrics`: Prometheus figures;
- :mod:`~cachecraft.server.app`: the routes (FastAPI), served by uvicorn.

Needs the ``server`` extra: ``pip install 'cachecraft[server]'``.
"""
