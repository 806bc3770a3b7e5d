"""``harness serve``: an OpenAI-compatible HTTP server over an HF causal LM.

``app.py`` is the HTTP API (routes, request validation, responses, limits; its docstring describes the
endpoints and their semantics), ``engine.py`` the continuous-batching engine behind it (one decode loop that requests join at any step).
"""

from opd_harness.serve.app import Limits, make_app, render_chat, serve

__all__ = ["Limits", "make_app", "render_chat", "serve"]
