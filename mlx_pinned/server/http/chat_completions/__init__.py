"""The chat-completions slice of the HTTP side: ``POST /v1/chat/completions``.

Event loop only, as all of :mod:`..http`. OpenAI's chat-completions
request and response models (:mod:`.protocol`, :mod:`.messages`,
:mod:`.responses`), and the route that answers them (:mod:`.route`).
"""
