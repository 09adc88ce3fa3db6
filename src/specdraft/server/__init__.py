"""``specdraft serve``: an OpenAI-compatible HTTP server over the continuous-batching scheduler.

Needs the ``serve`` extra (FastAPI, uvicorn, prometheus-client): ``pip install 'specdraft[serve]'``.
"""
