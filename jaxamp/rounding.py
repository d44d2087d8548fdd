"""Training with bfloat16 storage and no float32 copy: stochastic rounding, Kahan sums.

An update smaller than half a bfloat16 ulp of a weight rounds away when added in
bfloat16 (round to nearest), so pure bfloat16 storage stalls where float32 master
weights keep learning (Zamirai et al., "Revisiting BFloat16 Training", 2020). Two cures
keep the storage at 2 bytes per value:

- **stochastic rounding** (:func:`stochastic_round`, :func:`stochastic_rounding`): the
  float32 sum is rounded to one of its two neighbouring bfloat16 values, the upper one
  with probability equal to the distance from the lower one over their gap, so the
  rounding is unbiased (``E[round(x)] = x``) and small updates move the weight on
  average (Gupta et al., "Deep Learning with Limited Numerical Precision", 2015);
- **Kahan-compensated summation** (:func:`kahan_summation`): a bfloat16 buffer per
  weight holds what rounding lost, added back on the next update (Kahan, 1965).

Both are apply steps, the counterpart of ``optax.apply_updates`` with functional state:
``apply = stochastic_rounding(seed)``, ``state = apply.init(params)``, then each step
``params, state = apply.apply(params, updates, state)``. :func:`opt_state_dtype` stores
an optax transformation's floating state (Adam's moments) in a narrow dtype, rounded
either way. ``jaxamp.make_train_step(..., master_weights='stochastic' | 'kahan',
opt_state_dtype=jnp.bfloat16)`` uses them (see the memory guide).

Example:
  >>> import jax.numpy as jnp, jaxamp
  >>> apply = jaxamp.kahan_summation()
  >>> params = {'w': jnp.ones((3,), jnp.bfloat16)}
  >>> state = apply.init(params)
  >>> for _ in range(100):  # each update is below half a bfloat16 ulp of 1.0
  ...   params, state = apply.apply(params, {'w': jnp.full((3,), 1e-3)}, state)
  >>> params['w']  # round to nearest would leave 1.0
  Array([1.10156, 1.10156, 1.10156], dtype=bfloat16)
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax

__all__ = ["ApplyUpdates", "KahanState", "OptStateDtypeState", "ROUNDINGS",
           "StochasticRoundingState", "kahan_summation", "opt_state_dtype",
           "stochastic_round", "stochastic_rounding"]

ROUNDINGS = ("nearest", "stochastic")
"""How :func:`opt_state_dtype` rounds a float32 value into its storage dtype."""

_BF16 = np.dtype(jnp.bfloat16)


def stochastic_round(x: jax.Array, key: jax.Array) -> jax.Array:
  """``x`` rounded to bfloat16 stochastically: unbiased, to one of its two neighbours.

  The rule (torchao's ``_fp32_to_bf16_sr``; Gupta et al. 2015): add 16 uniformly
  random bits to the float32 bit pattern of ``x`` and drop its low 16 bits. The low
  bits ``f`` of ``x`` carry into the upper half with probability ``f / 2**16``, which
  is the distance from ``x`` to its lower-magnitude bfloat16 neighbour over the gap
  between the two neighbours: ``E[round(x)] = x``, and only those two values are ever
  picked. A value bfloat16 holds exactly is returned as it is. inf and NaN stay as they
  are (a NaN's pattern plus the bits could wrap to a finite value: such values take the
  plain cast); a finite value beyond bfloat16's largest rounds to it or to inf.

  Args:
    x: a float32 array (a bfloat16 one is returned as it is).
    key: a PRNG key (typed, or ``uint32`` key data); one draw of 16 bits per element.

  Returns:
    A bfloat16 array of ``x``'s shape.

  Example:
    >>> import jax, jax.numpy as jnp, jaxamp
    >>> x = jnp.full((20_000,), 1.0 + 2 ** -9)  # a quarter of the way to the next
    >>> r = jaxamp.stochastic_round(x, jax.random.key(0)).astype(jnp.float32)
    >>> sorted(set(r.tolist()))  # 1 and 1 + 2**-7, its neighbours
    [1.0, 1.0078125]
    >>> round(float(r.mean()), 3)  # ~ 1 + 2**-9 = 1.00195
    1.002
  """
  x = jnp.asarray(x)
  if x.dtype == _BF16:
    return x
  if x.dtype != np.dtype(jnp.float32):
    raise ValueError(f"stochastic_round rounds float32 values to bfloat16, got {x.dtype}; "
                     "cast to float32 first.")
  key = _typed(key)
  noise = jax.random.bits(key, x.shape, jnp.uint32) >> 16
  bits = jax.lax.bitcast_convert_type(x, jnp.uint32)
  rounded = (bits + noise) & jnp.uint32(0xFFFF0000)
  out = jax.lax.bitcast_convert_type(rounded, jnp.float32).astype(jnp.bfloat16)
  return jnp.where(jnp.isfinite(x), out, x.astype(jnp.bfloat16))


def _typed(key: jax.Array) -> jax.Array:
  """``key`` as a typed PRNG key (``uint32`` key data is wrapped)."""
  if jnp.issubdtype(key.dtype, jax.dtypes.prng_key):
    return key
  return jax.random.wrap_key_data(key)


def _leaf_keys(key: jax.Array, n: int) -> tuple[jax.Array, list[jax.Array]]:
  """The key a state keeps for the next step (``uint32`` data) and ``n`` keys for now."""
  key, now = jax.random.split(_typed(key))
  return jax.random.key_data(key), [jax.random.fold_in(now, i) for i in range(n)]


def _is_bf16(x: Any) -> bool:
  return hasattr(x, "dtype") and np.dtype(x.dtype) == _BF16


class ApplyUpdates(NamedTuple):
  """An apply step with state, the counterpart of ``optax.apply_updates``.

  Attributes:
    init: ``init(params) -> state``.
    apply: ``apply(params, updates, state) -> (new_params, new_state)``: the updates
      (float32, as an optimizer makes them for float32 inputs) added to the params in
      float32 and stored back in each parameter's dtype by the step's rule.
  """

  init: Callable[[Any], Any]
  apply: Callable[[Any, Any, Any], tuple[Any, Any]]


class StochasticRoundingState(NamedTuple):
  """State of :func:`stochastic_rounding`.

  Attributes:
    key: the PRNG key of the next rounding, as ``uint32`` key data
      (``jax.random.key_data``): a plain integer array that checkpoints, ``jnp.where``
      and sharding take as they are. Split once per applied step.
  """

  key: jax.Array


def stochastic_rounding(seed: int = 0) -> ApplyUpdates:
  """Applies updates in float32 and rounds each bfloat16 parameter stochastically.

  Each bfloat16 parameter becomes ``stochastic_round(float32(p) + u)`` (unbiased: in
  expectation the float32 sum, so updates far below a bfloat16 ulp still move it);
  parameters of other dtypes become ``p + u`` cast back to their dtype (round to
  nearest), as ``optax.apply_updates`` makes them. Each apply splits the state's key
  once; a step not applied (a skipped one) leaves the key, and so every later
  rounding, as they were.

  Args:
    seed: the seed of the first key.

  Returns:
    An :class:`ApplyUpdates` whose state is a :class:`StochasticRoundingState`.

  Example:
    >>> import jax.numpy as jnp, jaxamp
    >>> apply = jaxamp.stochastic_rounding(seed=0)
    >>> params = {'w': jnp.ones((10_000,), jnp.bfloat16)}
    >>> state = apply.init(params)
    >>> params, state = apply.apply(params, {'w': jnp.full((10_000,), 1e-3)}, state)
    >>> round(float(params['w'].astype(jnp.float32).mean()), 3)  # 1.001 on average
    1.001
  """

  def init(params: Any) -> StochasticRoundingState:
    del params
    return StochasticRoundingState(jax.random.key_data(jax.random.key(seed)))

  def apply(params: Any, updates: Any, state: StochasticRoundingState
            ) -> tuple[Any, StochasticRoundingState]:
    leaves, treedef = jax.tree.flatten(params)
    key, keys = _leaf_keys(state.key, len(leaves))
    ups = treedef.flatten_up_to(updates)
    out = [stochastic_round(p.astype(jnp.float32) + u.astype(jnp.float32), k)
           if _is_bf16(p) else _plain(p, u) for p, u, k in zip(leaves, ups, keys)]
    return treedef.unflatten(out), StochasticRoundingState(key)

  return ApplyUpdates(init, apply)


def _plain(p: Any, u: Any) -> Any:
  """``optax.apply_updates`` of one leaf: ``p + u`` in ``p``'s dtype."""
  if u is None:
    return p
  return jnp.asarray(p + u).astype(jnp.result_type(p))


class KahanState(NamedTuple):
  """State of :func:`kahan_summation`.

  Attributes:
    compensation: per parameter of a half dtype, what rounding its sums lost so far,
      negated (Kahan's ``c``), in the parameter's dtype and shape; for other
      parameters an empty array (shape ``(0,)``): nothing is compensated there.
  """

  compensation: Any


def _compensated(x: Any) -> bool:
  return (hasattr(x, "dtype") and jnp.issubdtype(x.dtype, jnp.floating)
          and np.dtype(x.dtype).itemsize < 4)


def kahan_summation() -> ApplyUpdates:
  """Applies updates to half-precision parameters with Kahan-compensated summation.

  For each parameter ``p`` of a half dtype, with its compensation ``c`` and update
  ``u``, in float32 (Kahan, "Further remarks on reducing truncation errors", 1965; the
  rule of Zamirai et al. 2020 and of the optimi library's Kahan optimizers)::

    y = u - c
    t = round(p + y)          # the new parameter, in p's dtype
    c = round((t - p) - y)    # minus what rounding lost, stored in p's dtype

  so ``p - c`` follows the float32 sum of the updates to within about a unit in the
  last place of the half-precision ``c``, far finer than ``p``'s own ulp. Parameters of
  float32 (or wider) dtypes are updated as ``optax.apply_updates`` does.

  Returns:
    An :class:`ApplyUpdates` whose state is a :class:`KahanState` (2 bytes per bfloat16
    parameter).

  Example:
    >>> import jax.numpy as jnp, jaxamp
    >>> apply = jaxamp.kahan_summation()
    >>> state = apply.init({'w': jnp.ones((2,), jnp.bfloat16), 'b': jnp.zeros((2,))})
    >>> state.compensation['w'].dtype, state.compensation['b'].shape
    (dtype(bfloat16), (0,))
  """

  def init(params: Any) -> KahanState:
    return KahanState(jax.tree.map(
        lambda p: jnp.zeros_like(p) if _compensated(p) else jnp.zeros((0,), p.dtype),
        params))

  def one(p: Any, u: Any, c: Any) -> tuple[Any, Any]:
    if not _compensated(p):
      return _plain(p, u), c
    p32 = p.astype(jnp.float32)
    y = u.astype(jnp.float32) - c.astype(jnp.float32)
    t = (p32 + y).astype(p.dtype)
    return t, ((t.astype(jnp.float32) - p32) - y).astype(c.dtype)

  def apply(params: Any, updates: Any, state: KahanState) -> tuple[Any, KahanState]:
    leaves, treedef = jax.tree.flatten(params)
    pairs = [one(p, u, c) for p, u, c in zip(leaves, treedef.flatten_up_to(updates),
                                              treedef.flatten_up_to(state.compensation))]
    return (treedef.unflatten([p for p, _ in pairs]),
            KahanState(treedef.unflatten([c for _, c in pairs])))

  return ApplyUpdates(init, apply)


class OptStateDtypeState(NamedTuple):
  """State of :func:`opt_state_dtype`.

  Attributes:
    inner_state: the wrapped transformation's state, its stored leaves in the narrow
      dtype.
    key: with ``rounding='stochastic'``, the PRNG key of the next rounding (``uint32``
      key data, split once per update); else None.
  """

  inner_state: Any
  key: jax.Array | None = None


def _stored(x: Any, dtype: np.dtype) -> bool:
  """Whether ``opt_state_dtype`` stores leaf ``x`` in ``dtype``: a real floating array
  of one dimension or more wider than it (moments); scalars (hyperparameters, counts,
  a 0-d parameter's moments) keep their dtype."""
  return (hasattr(x, "dtype") and jnp.issubdtype(x.dtype, jnp.floating)
          and np.ndim(x) >= 1 and np.dtype(x.dtype).itemsize > dtype.itemsize)


def opt_state_dtype(inner: optax.GradientTransformation, dtype: Any,
                    rounding: str = "nearest", seed: int = 0
                    ) -> optax.GradientTransformationExtraArgs:
  """``inner`` with its floating state (moments) stored in ``dtype``.

  Each update widens the stored leaves to float32, runs ``inner``'s update, and stores
  its new state back: rounded to nearest, or stochastically (:func:`stochastic_round`,
  bfloat16 only), which keeps a small change to a moment (Adam's second moment with
  ``b2=0.999`` moves by 0.1 % a step, below bfloat16's 0.4 % resolution) unbiased.
  Stored are real floating leaves of one dimension or more that are wider than
  ``dtype`` (float32 moments, Adafactor's factored statistics); integer leaves (counts),
  scalars (``inject_hyperparams``' values) and complex leaves keep their dtype.

  Args:
    inner: any optax transformation (``optax.adamw(3e-4)``, a chain...).
    dtype: the storage dtype (``jnp.bfloat16``, ``jnp.float16``).
    rounding: ``'nearest'`` or ``'stochastic'`` (bfloat16 storage only).
    seed: the seed of the stochastic rounding's key.

  Returns:
    A transformation whose state is an :class:`OptStateDtypeState`; extra arguments
    (``value``, a skip's verdict) pass to ``inner``.

  Example:
    >>> import jax.numpy as jnp, optax, jaxamp
    >>> tx = jaxamp.opt_state_dtype(optax.adam(1e-3), jnp.bfloat16, rounding='stochastic')
    >>> state = tx.init({'w': jnp.zeros((4,))})
    >>> adam = state.inner_state[0]
    >>> adam.mu['w'].dtype, adam.nu['w'].dtype, adam.count.dtype
    (dtype(bfloat16), dtype(bfloat16), dtype('int32'))
  """
  if rounding not in ROUNDINGS:
    raise ValueError(f"opt_state_dtype rounding must be one of "
                     f"{', '.join(map(repr, ROUNDINGS))}, got {rounding!r}.")
  try:
    dtype = np.dtype(dtype)
  except TypeError:
    dtype = None
  if dtype is None or not jnp.issubdtype(dtype, jnp.floating):
    raise ValueError("opt_state_dtype dtype must be a floating dtype (jnp.bfloat16, "
                     f"jnp.float16, jnp.float32), got {dtype!r}.")
  if rounding == "stochastic" and dtype != _BF16:
    raise ValueError(f"opt_state_dtype(rounding='stochastic') rounds to bfloat16; got "
                     f"dtype {dtype.name}. Use jnp.bfloat16, or rounding='nearest'.")
  inner = optax.with_extra_args_support(inner)

  def store(tree: Any, keys: list[jax.Array] | None) -> Any:
    leaves, treedef = jax.tree.flatten(tree)
    out = []
    for i, x in enumerate(leaves):
      if not _stored(x, dtype):
        out.append(x)
      elif keys is not None:
        out.append(stochastic_round(x.astype(jnp.float32), jax.random.fold_in(keys[0], i)))
      else:
        out.append(x.astype(dtype))
    return treedef.unflatten(out)

  def init(params: Any) -> OptStateDtypeState:
    key = (jax.random.key_data(jax.random.key(seed)) if rounding == "stochastic" else None)
    return OptStateDtypeState(store(inner.init(params), None), key)

  def update(updates: Any, state: OptStateDtypeState, params: Any = None,
             **extra_args: Any) -> tuple[Any, OptStateDtypeState]:
    # The stored dtype of each leaf is known from the state itself: widen the narrow
    # ones. An init'd state's leaves were wider than dtype wherever they are stored.
    wide = jax.tree.map(lambda x: x.astype(jnp.float32) if _narrowed(x, dtype) else x,
                        state.inner_state)
    updates, new = inner.update(updates, wide, params, **extra_args)
    key, keys = (None, None) if state.key is None else _leaf_keys(state.key, 1)
    return updates, OptStateDtypeState(store(new, keys), key)

  return optax.GradientTransformationExtraArgs(init, update)


def _narrowed(x: Any, dtype: np.dtype) -> bool:
  """Whether ``x`` is a leaf :func:`opt_state_dtype` stored in ``dtype``."""
  return (hasattr(x, "dtype") and np.dtype(x.dtype) == dtype and np.ndim(x) >= 1
          and dtype.itemsize < 4)
