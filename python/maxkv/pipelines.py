"""The ``--custom-architectures`` entry point: ``max generate`` and ``max serve`` on maxkv.

MAX loads this module and reads :data:`ARCHITECTURES`; everything here is
:mod:`maxkv.serving.pipelines`, where the adapter, the model and the
architecture live.  Importing it installs what maxkv changes in MAX for the
serving process (:func:`maxkv.serving.pipelines.install`); importing
:mod:`maxkv` or :mod:`maxkv.serving.pipelines` changes nothing of MAX's.
``python -c "import maxkv.pipelines as p; print(p.CUSTOM_ARCHITECTURES)"`` prints
the flag's value.
"""

from .serving.pipelines import *  # noqa: F403
from .serving.pipelines import __all__ as __all__
from .serving.pipelines import install

install()
