"""`ds4jax serve`: an OpenAI-compatible HTTP server on one `Engine` (docs/serving.md).

    app.py        the Starlette app: routes, auth, body limits, error handlers, lifespan (warm-up, drain)
    params.py     request bodies -> validated `GenerationParams` (unknown fields rejected by name)
    chat.py       DeepSeek-V4's chat format (thinking on / off) and the reasoning / content split
    text.py       incremental detokenization with stop strings (what is streamed is what is returned)
    driver.py     the one thread that owns the engine: a bounded submission queue, cancellation, shutdown
    handoff.py    the engine thread's items to the event loop, one wake-up per burst
    engine_process.py  the engine in a process of its own (the default): its messages, `RemoteDriver` for the app
    responses.py  OpenAI JSON for completions and chat (whole responses and stream chunks)
    metrics.py    Prometheus metrics
    errors.py     OpenAI's error shape with ds4jax's codes
    server.py     uvicorn with graceful SIGTERM
"""
