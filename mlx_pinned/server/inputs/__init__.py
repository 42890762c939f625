"""Inputs of a request that are read off the event loop and off the MLX
thread: images decoded in worker threads, remote images fetched (when
allowed) with SSRF rules. Never imports MLX or the HTTP side."""
