"""The OpenAI-compatible HTTP API on Ray Serve (``atomr serve``).

    from atomr_infer.serve import run_server, stop_server
    server = run_server("127.0.0.1", 8000)   # base_url for the openai client: server.base_url
"""

from atomr_infer.serve.server import APP_NAME, Server, run_server, running_server, stop_server

__all__ = ["APP_NAME", "Server", "run_server", "running_server", "stop_server"]
