"""``diffuse serve``: models kept warm on a ring of nodes, answering on an OpenAI-compatible HTTP API, with a
page at ``/`` to chat and generate (``python -m diffuse.serve``). What each file holds:

- ``command``: the command (``main``): its flags, the ``Service`` it starts (models analysed and loaded, nodes
  started or dialled) and the socket it serves on.
- ``engines``: what the service keeps warm per model: the engine base, its pool of client ends (the bounded queue
  of requests), the model's nodes, a request's ``Cancel``.
- ``language``: the language-model engine (chat, completions, transcription, speech).
- ``pipeline``: the pipeline engine (images, videos, sound) and a video's preview frames.
- ``app``: the HTTP app: its endpoints put together, the bearer key, a log line per request, errors in the
  OpenAI shape, the body limit.
- ``plumbing``: what every endpoint shares: ``ApiError``, the JSON body and its fields, the model a request
  names, work in a worker thread, server-sent events.
- ``chat``: chat and text completions. ``media``: images, video jobs, transcription and speech. ``jobs``: the
  video job table. ``info``: the page, the models, the ring's health.
- ``page/``: the page's HTML, CSS and JavaScript.
"""
