"""The ``--custom-architectures`` entry point: ``max generate`` and ``max serve`` on maxkv.

MAX loads this module and reads :data:`ARCHITECTURES`; everything here is
:mod:`maxkv.serving.pipelines`, where the adapter, the model and the
architecture live.  ``python -c "import maxkv.pipelines as p;
print(p.CUSTOM_ARCHITECTURES)"`` prints the flag's value.
"""

from .serving.pipelines import *  # noqa: F403
from .serving.pipelines import __all__ as __all__
