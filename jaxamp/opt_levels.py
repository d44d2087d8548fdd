"""Apex-style optimization levels: ``O0``–``O3`` as self-contained presets.

:func:`opt_level` returns an :class:`OptLevel`, a NamedTuple of everything a level
decides. The presets follow Apex's ``amp.initialize`` (``half`` is the half dtype,
float16 by default as in Apex):

===== ================================ ============ ======== ================== ==============
level policy                           loss_scale   autocast keep_norms_float32 master_weights
===== ================================ ============ ======== ================== ==============
O0    float32                          None         False    True               False
O1    params float32, compute half,    'dynamic'    True     True               False
      output float32
O2    half (params, compute, output)   'dynamic'    False    True               True
O3    half                             None         False    False              False
===== ================================ ============ ======== ================== ==============

O1 runs the float32 model through :func:`jaxamp.autocast` (op lists decide each
primitive's precision, norms decompose into float32 primitives); O2 runs half-precision
modules, keeps norm layers (every class of :data:`jaxamp.NORM_CLASSES`, where Apex's
``keep_batchnorm_fp32`` covers BatchNorm) in float32, parameters and compute, and updates
float32 master weights; O3 is pure half precision.
:meth:`TrainStep.init <jaxamp.TrainStep.init>` stores each parameter in its module's
param dtype: it sees an NNX model's modules; a Linen module's only when ``init`` also gets
the module's example arguments (otherwise every parameter, norm scales included, is
stored in the half dtype; norms still compute in float32). With ``half=jnp.bfloat16`` no
level scales the loss (bfloat16 has float32's range). Keyword overrides replace fields,
as in Apex.

Example:
  >>> import jax.numpy as jnp, jaxamp
  >>> level = jaxamp.opt_level('O2')
  >>> level.policy.name, level.loss_scale, level.master_weights
  ('float16', 'dynamic', True)
  >>> level = jaxamp.opt_level('O1', half=jnp.bfloat16, keep_norms_float32=False)
  >>> level.policy.compute_dtype, level.loss_scale, level.autocast, level.keep_norms_float32
  (dtype(bfloat16), None, True, False)
"""

from __future__ import annotations

import numbers
from collections.abc import Callable
from typing import Any, NamedTuple, Union

import jax.numpy as jnp
import numpy as np

from jaxamp import dtypes
from jaxamp.casting import at_least_float32
from jaxamp.policy import get_policy, Policy
from jaxamp.rules import pure_policy_fn

__all__ = ["OPT_LEVELS", "LossScaleSpec", "OptLevel", "opt_level"]

OPT_LEVELS: tuple[str, ...] = ("O0", "O1", "O2", "O3")

# 'dynamic', None (no scaling), a positive number (a static scale), or a zero-argument
# factory returning a loss-scale optax transformation.
LossScaleSpec = Union[str, float, None, Callable[[], Any]]

_F32 = np.dtype(jnp.float32)


class OptLevel(NamedTuple):
  """An optimization level: the settings a mixed-precision run needs, in one value.

  Attributes:
    name: ``'O0'``, ``'O1'``, ``'O2'`` or ``'O3'``.
    policy: the :class:`jaxamp.Policy`. With ``autocast`` it is autocast's policy (its
      compute dtype is what matmuls run in) and the model stays float32; otherwise it is
      the model-level module policy.
    loss_scale: ``'dynamic'``, None (no scaling), a positive number (static scale) or a
      zero-argument factory; :meth:`make_loss_scale` builds it.
    autocast: run the loss function through :func:`jaxamp.autocast` with ``policy``.
    keep_norms_float32: normalization layers compute in float32 even when the policy
      computes in half precision.
    master_weights: the optimizer updates float32 master weights while the model gets
      their casts to each parameter's stored dtype (``policy.param_dtype``; float32 for
      norms kept in float32).
  """

  name: str
  policy: Policy
  loss_scale: LossScaleSpec
  autocast: bool
  keep_norms_float32: bool
  master_weights: bool

  def norm_rule(self) -> Any:
    """The rule this level gives normalization layers in place of the default.

    With ``keep_norms_float32`` norms store their parameters and compute in float32 and
    return the enclosing compute dtype (Apex's ``keep_batchnorm_fp32``, here for every
    class of :data:`jaxamp.NORM_CLASSES`); without it, None: no rule of their own, so
    they run under the level's policy. Rules a user set for a norm class take precedence
    (see :func:`jaxamp.rules.norm_defaults`).

    Example:
      >>> import jaxamp
      >>> jaxamp.opt_level('O2').norm_rule()(jaxamp.get_policy('float16')).name
      'params=float32,compute=float32,output=float16'
      >>> jaxamp.opt_level('O3').norm_rule() is None
      True
    """
    return _float32_norm if self.keep_norms_float32 else None

  def make_loss_scale(self) -> Any:
    """The loss-scale optax transformation ``loss_scale`` names.

    ``'dynamic'`` gives :func:`jaxamp.dynamic_loss_scale` (its defaults), None
    :func:`jaxamp.no_loss_scale`, a number :func:`jaxamp.static_loss_scale`, a factory
    whatever it returns.
    """
    from jaxamp import loss_scale  # pylint: disable=g-import-not-at-top  # a higher layer

    spec = _check_loss_scale(self.loss_scale)
    if spec is None:
      return loss_scale.no_loss_scale()
    if isinstance(spec, str):
      return loss_scale.dynamic_loss_scale()
    if callable(spec):
      return spec()
    return loss_scale.static_loss_scale(float(spec))


_FIELDS = tuple(f for f in OptLevel._fields if f != "name")


@pure_policy_fn
def _float32_norm(enclosing: Policy) -> Policy:
  return Policy(at_least_float32(enclosing.param_dtype),
                at_least_float32(enclosing.compute_dtype), enclosing.compute_dtype)


def _check_loss_scale(value: Any) -> LossScaleSpec:
  if value is None or value == "dynamic" or callable(value):
    return value
  if isinstance(value, numbers.Real) and not isinstance(value, bool):
    from jaxamp.loss_scale import _check_scale  # pylint: disable=g-import-not-at-top

    try:
      _check_scale("loss_scale", value)  # now, not when the step is built
      return value
    except ValueError as e:
      reason = f" ({e})"
  else:
    reason = ""
  raise ValueError(f"loss_scale must be 'dynamic', None, a positive finite number or a "
                   f"zero-argument factory, got {value!r}{reason}.")


def _check_overrides(overrides: dict[str, Any]) -> dict[str, Any]:
  unknown = sorted(set(overrides) - set(_FIELDS))
  if unknown:
    raise ValueError(f"Unknown opt_level override(s) {unknown}; valid ones are "
                     f"{list(_FIELDS)}.")
  checked = dict(overrides)
  if "policy" in checked:
    checked["policy"] = get_policy(checked["policy"])
  if "loss_scale" in checked:
    checked["loss_scale"] = _check_loss_scale(checked["loss_scale"])
  for flag in ("autocast", "keep_norms_float32", "master_weights"):
    if flag in checked and not isinstance(checked[flag], bool):
      raise ValueError(f"{flag} must be True or False, got {checked[flag]!r}.")
  return checked


def _preset(name: str, half: np.dtype) -> OptLevel:
  # float16 needs loss scaling to keep small gradients representable; bfloat16 does not.
  scale = "dynamic" if half == np.dtype(jnp.float16) else None
  if name == "O0":
    return OptLevel(name, Policy(_F32), None, autocast=False, keep_norms_float32=True,
                    master_weights=False)
  if name == "O1":
    return OptLevel(name, Policy(_F32, half, _F32), scale, autocast=True,
                    keep_norms_float32=True, master_weights=False)
  if name == "O2":
    return OptLevel(name, Policy(half), scale, autocast=False, keep_norms_float32=True,
                    master_weights=True)
  return OptLevel(name, Policy(half), None, autocast=False, keep_norms_float32=False,
                  master_weights=False)


def opt_level(level: str | OptLevel, *, half: Any = jnp.float16, **overrides: Any) -> OptLevel:
  """The preset of an Apex optimization level, with keyword overrides.

  Args:
    level: ``'O0'``, ``'O1'``, ``'O2'``, ``'O3'`` (the letter O), or an
      :class:`OptLevel` to apply ``overrides`` to.
    half: the half dtype, ``jnp.float16`` (default, as Apex) or ``jnp.bfloat16``
      (then no level scales the loss).
    **overrides: replacements for the fields ``policy`` (anything
      :func:`jaxamp.get_policy` accepts), ``loss_scale``, ``autocast``,
      ``keep_norms_float32``, ``master_weights``.

  Returns:
    The :class:`OptLevel`.

  Raises:
    ValueError: an unknown level, half dtype, override or override value; the
      message lists the valid ones.

  Example:
    >>> import jaxamp
    >>> jaxamp.opt_level('O3').policy.name, jaxamp.opt_level('O0', loss_scale=128.0).loss_scale
    ('float16', 128.0)
  """
  checked = _check_overrides(overrides)
  if isinstance(level, OptLevel):
    return level._replace(**checked)
  if level not in OPT_LEVELS:
    hint = (" (the prefix is the letter O, not the digit zero)"
            if isinstance(level, str) and level[:1] == "0" else "")
    raise ValueError(f"Unknown opt level {level!r}{hint}; valid levels are "
                     f"{', '.join(repr(v) for v in OPT_LEVELS)}.")
  try:
    half_dtype = np.dtype(half)
  except TypeError:
    half_dtype = None
  if half_dtype is None or not dtypes.is_half(half_dtype):
    raise ValueError(f"half must be float16 or bfloat16, got {half!r}.")
  return _preset(level, half_dtype)._replace(**checked)
