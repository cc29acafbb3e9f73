"""A local OpenAI- and Anthropic-compatible HTTP server on the engine worker.

``engine.server.bridge`` talks to the ``EngineWorker`` (and only to it) from the
server's threads; ``engine.server.app`` is the Starlette application;
``engine.server.protocol`` reads and checks request bodies;
``engine.server.pipeline`` is the bridge over a pipeline of machines
(``RemoteWorker``) and its fallback to this one.
"""
