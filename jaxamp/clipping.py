"""Clipping by global norm that reuses a norm the caller has already computed.

:func:`jaxamp.make_train_step` computes the float32 global norm of the unscaled gradients
on every step: it is the ``grad_norm`` metric and the skip verdict (a finite norm). An
``optax.clip_by_global_norm`` later in the chain computes that same norm again, inside the
update, where XLA cannot share it with the step's: one more reduction per parameter, one
more read of every gradient per step. On XLA:CPU each of those reductions is also its own
compiled kernel, so the second norm lengthens compiling too (``benchmarks/compile``).

:func:`clip_by_global_norm` clips exactly as optax's does (the update is left alone while
its norm is below ``max_norm``, else scaled by ``max_norm / norm``; a complex leaf counts
both parts, as in ``optax.tree.norm``). Inside a train step it takes the step's norm, and
only when the updates it receives are the very arrays the step took the norm of (checked
by identity while tracing: an element before it that changes the updates, e.g.
``optax.scale``, makes it compute its own). Anywhere else it computes its own, in
float32 (float64 for float64 leaves).

Example:
  >>> import jax.numpy as jnp, optax, jaxamp
  >>> clip = jaxamp.clip_by_global_norm(1.0)
  >>> updates, _ = clip.update({'w': jnp.array([3.0, 4.0])}, clip.init(None))
  >>> updates['w']
  Array([0.6, 0.8], dtype=float32)
"""

from __future__ import annotations

import numbers
from typing import Any

import jax
import numpy as np
import optax

from jaxamp.casting import is_inexact_array
# The norm a caller offers is part of the skip's verdict protocol (jaxamp.skip); its
# names are re-exported here, where they have always been.
from jaxamp.skip import GLOBAL_NORM, KnownNorm, Verdict, unscaled_norm_and_finite

__all__ = ["GLOBAL_NORM", "KnownNorm", "clip_by_global_norm"]


def clip_by_global_norm(max_norm: float) -> optax.GradientTransformationExtraArgs:
  """``optax.clip_by_global_norm``, reusing the train step's norm of the same gradients.

  Args:
    max_norm: the largest global norm an update keeps; a positive number (or a scalar
      array, as ``optax.inject_hyperparams`` passes it).

  Returns:
    An optax transformation with optax's clipping rule and empty state. Its norm is
    taken in float32, or float64 for float64 leaves (optax's, in each leaf's own dtype,
    differs for half-precision leaves by their rounding).

  Example:
    >>> import jax, jax.numpy as jnp, optax, jaxamp
    >>> from flax import nnx
    >>> opt = optax.chain(jaxamp.clip_by_global_norm(1.0), optax.sgd(0.1))
    >>> train = jaxamp.make_train_step(lambda m, b: jnp.mean((m(b) - 10.0) ** 2), opt)
    >>> state = train.init(nnx.Linear(2, 1, rngs=nnx.Rngs(0)))
    >>> state, metrics = train.step(state, jnp.ones((4, 2)))
    >>> bool(metrics['grad_norm'] > 1.0)  # clipped to norm 1, with the step's norm
    True
  """
  if isinstance(max_norm, (jax.Array, np.ndarray)):
    # Values unchecked (they may be traced): optax.inject_hyperparams passes arrays.
    valid = np.ndim(max_norm) == 0
  else:  # Python and NumPy numbers (np.float32 included), not bools
    valid = (isinstance(max_norm, numbers.Real) and not isinstance(max_norm, (bool, np.bool_))
             and max_norm > 0)
  if not valid:
    raise ValueError(f"clip_by_global_norm: max_norm must be a positive number, got "
                     f"{max_norm!r}.")

  def update_fn(updates: Any, state: Any, params: Any = None,
                **extra_args: Any) -> tuple[Any, Any]:
    del params
    known = Verdict.read(extra_args).norm
    norm = known.norm_of(updates) if known is not None else None
    if norm is None:
      norm = unscaled_norm_and_finite(updates, None)[1]
    trigger = norm < max_norm

    def clip(t: Any) -> Any:
      if not is_inexact_array(t):  # complex leaves are clipped too
        return t
      return jax.lax.select(trigger, t, (t / norm.astype(t.dtype)) * max_norm)

    return jax.tree.map(clip, updates), state

  return optax.GradientTransformationExtraArgs(optax.init_empty_state, update_fn)
