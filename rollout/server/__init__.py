"""The HTTP server: OpenAI-compatible serving and SGLang-style RL control endpoints (``server`` extra).

``rollout.launch_server`` starts it; ``rollout.server.app.create_app`` builds the FastAPI app. Modules:
``server_args`` (the flags), ``state`` (the engine and what handlers share), ``protocol`` (request
bodies), ``openai_api`` / ``generate_api`` / ``control_api`` (routes), ``streaming`` (SSE and client
disconnects), ``errors`` (JSON errors), ``metrics`` (Prometheus). Importing this package imports
nothing heavy; FastAPI is imported by the modules that need it.
"""
