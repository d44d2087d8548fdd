"""Per-module mixed-precision policies for unmodified Flax NNX models.

:func:`with_policy` returns a :class:`PolicyModule` to call in place of a model. It
holds the same Variables (an update through one is seen by the other) and calling it
runs every submodule under its resolved policy (:func:`jaxamp.resolve_policy`: path
rules, then class rules, then the enclosing module's policy; the model itself takes
the model-level policy). Inside a module whose compute dtype is ``c``:

- floating positional and keyword arguments are cast to ``c``; integers (token ids),
  booleans (masks), PRNG keys, ``nnx.Rngs`` and other graph nodes pass untouched;
- the module's own floating ``nnx.Param`` s (attributes it holds directly, also inside
  ``nnx.List``/``nnx.Dict``/plain containers, not those of its submodules) read as
  ``c``: ``x @ self.w[...]`` in a module you wrote computes in ``c``. The stored
  values never change dtype, so gradients come back in the stored (param) dtype;
- a ``dtype`` attribute (``None`` or floating, as every Flax layer has) reads ``c``:
  this is what makes ``nnx.Embed``, ``nnx.MultiHeadAttention`` and its projections,
  whose ``dtype`` was fixed at construction, compute in ``c``;
- floating outputs are cast to the policy's output dtype;
- every floating Variable keeps its stored dtype (an in-call update written in another
  dtype is cast back): BatchNorm's ``BatchStat`` stays float32 and, computed in float32
  by default, is updated in float32; the decoding ``nnx.Cache`` of an attention layer
  (``nnx.MultiHeadAttention``, or a class named like one: ``jaxamp.rules.
  is_named_attention``) is read in ``c`` like a parameter and stays in the dtype
  ``init_cache`` gave it. Any other ``nnx.Cache`` (a running sum, a recurrent state
  your module keeps) is read and updated in its stored dtype: a float32 one
  accumulates in float32.

Some built-in layers get targeted treatment:

- ``nnx.Embed.__call__`` is a gather, not a matmul: it looks rows up in the stored
  dtype and casts only the rows (the same values; no cast of the whole table, and the
  table's gradient is accumulated in float32). ``Embed.attend`` is a matmul and reads
  the table in ``c``.
- ``nnx.MultiHeadAttention`` with its default ``attention_fn`` and a half ``c`` uses
  :func:`half_dot_product_attention`: float32 logits and softmax as in
  ``jax.nn.dot_product_attention``, but without the ``F16_F16_F32`` dot algorithm XLA
  on CPU rejects, and with half-precision operands in the backward matmuls too.
- ``nnx.LayerNorm``, ``nnx.RMSNorm``, ``nnx.GroupNorm`` and ``nnx.BatchNorm`` compute
  in float32 by default inside a half model. With ``recompute_norms=True`` those that
  compute wider than their inputs run under ``jax.checkpoint``: reverse mode keeps their
  half-precision input instead of float32 intermediates and recomputes the norm in the
  backward pass. Off by default: it saves activation memory but costs time on a GPU
  (ResNet-50 step 1.25× with it in a run not kept, 1.03× the hand-set model without:
  ``benchmarks/gpu``).

Linen modules bridged with ``nnx.bridge.ToNNX`` run through
:func:`jaxamp.linen.with_policy` under the ``ToNNX`` module's policy (rule paths
inside them count from the Linen module). The first outermost call per model class,
policy, method and input shapes traces a copy of the model (``jax.make_jaxpr``) under
per-module scopes and warns once if a module computing in half by policy still runs
matmuls in float32 (:mod:`jaxamp.census`).

How: NNX has no method interceptor, so while the wrapper runs, each module instance of
the graph is given a cached policy-aware subclass of its class (``__call__`` and the
methods of :data:`POLICY_METHODS` wrapped) and its resolved policy as a static
attribute; both are restored when the call returns. Modules that NNX transforms
re-create inside the call (``nnx.scan``, ``nnx.vmap``, ``nnx.remat``) carry both with
them, because both are part of the graph definition. Params are cast on read through
the Variable ``on_get_value`` hook, so transforms see float32 state.

Limits: policies and rules are read when the call is traced: under ``jax.jit`` or
``nnx.jit`` a function traced once keeps them (with ``policy=None``, the global policy
of that moment) until it is traced again. Modules constructed during the call run
unmodified. A model must not be called from two threads while a wrapped call of it
runs (its instances are shared). Variables made with ``hijax=True`` are not cast on
read (the ``dtype`` attribute still covers the built-in layers).

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
