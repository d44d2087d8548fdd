"""The model libraries jaxamp runs, behind one protocol and one registry.

:class:`Library` is what an entry point may ask of a model library; :func:`library_of`
finds the registered library that accepts a model. Flax NNX, Flax Linen and Equinox are
registered here, in that order (Equinox also takes other pytrees of floating arrays for
the train step). ``Plan.adapter`` is an :class:`Adapter`, made by
:meth:`Library.split`.

Example:
  >>> from jaxamp import adapters
  >>> [lib.name for lib in adapters.libraries()]
  ['nnx', 'linen', 'equinox']
"""

from jaxamp.adapters._registry import (Adapter, Library, Split, libraries, library_of,
                                       register, with_policy, is_node, value_of)
from jaxamp.adapters._common import module_params
from jaxamp.adapters._nnx import NNX, Float32Outputs, NNXAdapter
from jaxamp.adapters._linen import LINEN, LinenAdapter, stream_keys
from jaxamp.adapters._equinox import EQUINOX, EquinoxAdapter

register(NNX)
register(LINEN)
register(EQUINOX)

__all__ = ["Adapter", "Library", "Split", "libraries", "library_of", "register",
           "with_policy", "is_node", "value_of",
           "module_params", "NNX", "LINEN", "EQUINOX", "NNXAdapter", "LinenAdapter",
           "EquinoxAdapter", "Float32Outputs", "stream_keys"]
