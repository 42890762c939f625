"""A request's images, videos and audio, fetched (where allowed) on the
event loop and decoded in worker threads. Never imports MLX or the HTTP
side."""
