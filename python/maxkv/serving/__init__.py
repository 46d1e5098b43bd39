"""Serving on top of the cache and the model.

- :mod:`~maxkv.serving.scheduler`: maxkv's own continuous-batching scheduler
  (multistep decoding, prefix caching, forks), what the demo runs.
- :mod:`~maxkv.serving.pipelines`: MAX's pipelines (``max generate``, ``max
  serve``) on maxkv's cache and graph: a MAX custom architecture whose entry
  point is :mod:`maxkv.pipelines`.
"""
