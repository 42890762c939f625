"""The HTTP side of the server: the event loop only. It never imports MLX: it
reaches a model through its kind's engine protocol."""
