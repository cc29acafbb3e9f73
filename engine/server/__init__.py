"""A local OpenAI-, Anthropic- and Ollama-compatible HTTP server on the engine worker.

``engine.server.bridge`` talks to the ``EngineWorker`` (and only to it) from the
server's threads; ``engine.server.app`` is the Starlette application;
``engine.server.protocol`` reads and checks OpenAI and Anthropic request bodies,
``engine.server.responses`` OpenAI's Responses API and ``engine.server.ollama``
Ollama's, each against its table in ``engine.server.fields`` (every field of
the API's schema: honoured, accepted or refused); ``engine.server.pipeline`` is
the bridge over a pipeline of machines (``RemoteWorker``) and its fallback to
this one; ``engine.server.connections`` is uvicorn's HTTP protocol with a bound
on reading a request's head.
"""
