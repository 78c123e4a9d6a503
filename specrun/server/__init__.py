"""`specrun serve`: an OpenAI-compatible server in front of one target/drafter pair.

- ``requests.py``: what a request may ask: its fields parsed and validated into a
  ``CompletionRequest``, or a ``RequestError`` naming the bad one.
- ``worker.py``: the thread that owns the loaded pair (``PairWorker``, from ``PairOptions``)
  and answers ``Job``s one at a time, sending back their events; the stop-string cutter.
- ``app.py``: the HTTP side: the routes (``OpenAIServer``), the OpenAI response objects,
  and ``serve``, which binds the port, starts the worker and runs uvicorn.
"""
