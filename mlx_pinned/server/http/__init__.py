"""The HTTP side of the server: the event loop only (Starlette, pydantic,
prometheus). It never imports MLX: it reaches the model through the
:class:`~..events.Engine` that ``app.py`` wires in."""
