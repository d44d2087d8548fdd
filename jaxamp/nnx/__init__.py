"""Per-module mixed-precision policies for unmodified Flax NNX models.

:func:`with_policy` returns a :class:`PolicyModule` to call in place of a model. It
holds the same Variables (an update through one is seen by the other) and calling it
runs every submodule under its resolved policy (:func:`jaxamp.resolve_policy`: path
rules, then class rules, then the enclosing module's policy; the model itself takes
the model-level policy). Inside a module whose compute dtype is ``c``:

- floating arguments are cast to ``c``; integers (token ids), booleans (masks), PRNG
  keys, ``nnx.Rngs`` and other graph nodes pass untouched;
- the module's own floating ``nnx.Param`` s read as ``c`` (``x @ self.w[...]`` in a
  module you wrote computes in ``c``); stored values and their gradients keep the
  param dtype;
- a ``dtype`` attribute (every Flax layer has one) reads ``c``, so ``nnx.Embed`` and
  ``nnx.MultiHeadAttention`` compute in it; floating outputs are cast to the policy's
  output dtype;
- every floating Variable keeps its stored dtype (BatchNorm's statistics stay float32);
  only an attention layer's decoding ``nnx.Cache`` is read in ``c``.

Norms compute in float32 by default (``recompute_norms=True`` recomputes them in the
backward pass: less activation memory, more time). Linen modules bridged with
``nnx.bridge.ToNNX`` run through :func:`jaxamp.linen.with_policy`. The first call warns
once if a module computing in half still runs matmuls in float32 (:mod:`jaxamp.census`),
and :func:`module_policies` lists the policy of every module. The built-in layers with
their own treatment, and what the wrapper cannot see: ``docs/guides/policies.md``.

Example:
  >>> import jax.numpy as jnp
  >>> import jaxamp
  >>> from flax import nnx
  >>> model = nnx.Sequential(nnx.Linear(4, 8, rngs=nnx.Rngs(0)), nnx.relu,
  ...                        nnx.Linear(8, 2, rngs=nnx.Rngs(1)))
  >>> amp = jaxamp.nnx.with_policy(model, 'mixed_bfloat16')
  >>> amp(jnp.ones((3, 4))).dtype, model.layers[0].kernel.dtype
  (dtype(bfloat16), dtype('float32'))
  >>> [(path, p.name) for path, _, p in jaxamp.nnx.module_policies(amp)][-1]
  ('', 'mixed_bfloat16')
"""

# The implementation, by concept: _plan (the module walk), _variables (how Variables read
# and keep their dtypes), _call (one module method under its policy), _wrapper
# (PolicyModule, with_policy, the float32-matmul check), _attention.
from jaxamp.nnx._attention import half_dot_product_attention
from jaxamp.nnx._call import POLICY_METHODS
from jaxamp.nnx._plan import _iter_modules  # noqa: F401  (tests walk models with it)
from jaxamp.nnx._wrapper import PolicyModule, module_policies, with_policy

__all__ = [
    "POLICY_METHODS",
    "PolicyModule",
    "half_dot_product_attention",
    "module_policies",
    "with_policy",
]
