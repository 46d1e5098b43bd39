"""What maxkv changes in MAX for a process that serves it, installed by one call.

Importing :mod:`maxkv` or :mod:`maxkv.serving.pipelines` changes nothing of
MAX's.  :func:`install` makes the changes a serving process needs, each through
its seam (:mod:`maxkv.seams`), once per process:

- the OpenAI request parser checks each request first
  (:func:`~maxkv.serving.pipelines.api.refuse_unsupported_requests`);
- the render routes KV-aware routers ask for tokens
  (:func:`~maxkv.serving.pipelines.render.add_render_routes`) and ``n`` /
  ``best_of`` in front of the completion and chat routes
  (:func:`~maxkv.serving.pipelines.choices.wrap_choice_routes`), before the
  server's app takes the routes in;
- the model worker's scheduler remembers cancels that come before their request
  (:func:`~maxkv.serving.pipelines.cancels.remember_cancels`);
- ``--kv-cache-format`` takes maxkv's own encodings
  (:func:`~maxkv.serving.pipelines.model.accept_maxkv_formats`).

Who calls it: :mod:`maxkv.pipelines`, the module MAX imports for
``--custom-architectures`` (in ``max generate`` and in ``max serve``'s API
process, before MAX reads its configuration or builds its app), and
:class:`~maxkv.serving.pipelines.architecture.MaxkvTextGenerationPipeline`'s
constructor (the model worker, which unpickles maxkv's classes without
importing the entry point).
"""

from __future__ import annotations

from .api import refuse_unsupported_requests
from .cancels import remember_cancels
from .choices import wrap_choice_routes
from .model import accept_maxkv_formats
from .render import add_render_routes


def install() -> None:
    """Makes every change above (each once per process: a second call does nothing)."""
    accept_maxkv_formats()
    refuse_unsupported_requests()
    add_render_routes()
    wrap_choice_routes()
    remember_cancels()
