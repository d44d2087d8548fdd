"""Mixed-precision policies: names, parsing, the global policy and scopes.

A :class:`Policy` names three dtypes: how parameters are stored (``param_dtype``),
what matmuls and convolutions run in (``compute_dtype``) and what a module
returns (``output_dtype``). Policies are parsed from Keras names
(``'mixed_bfloat16'``), jmp strings (``'params=float32,compute=bfloat16'``),
``jmp.Policy`` objects and dtypes.

Example:
  >>> import jaxamp
  >>> p = jaxamp.get_policy('mixed_bfloat16')
  >>> p
  Policy(param_dtype='float32', compute_dtype='bfloat16', output_dtype='bfloat16')
  >>> jaxamp.get_policy('p=f32,c=bf16,o=f32').name
  'params=float32,compute=bfloat16,output=float32'
  >>> with jaxamp.policy_scope('mixed_bfloat16'):
  ...   jaxamp.global_policy().name
  'mixed_bfloat16'
  >>> jaxamp.global_policy().name
  'float32'
"""

from __future__ import annotations

import contextlib
import dataclasses
import difflib
import threading
from collections.abc import Iterator
from typing import Any, Union

import jax
import jax.numpy as jnp
import numpy as np

from jaxamp import _warn_once, dtypes, recipes, scaled
from jaxamp.casting import cast_floating

__all__ = [
    "Policy",
    "PolicyLike",
    "get_policy",
    "global_policy",
    "set_global_policy",
    "policy_scope",
    "POLICY_NAMES",
]

_FLOAT32 = np.dtype(jnp.float32)

# Keras names: a dtype name sets all three; 'mixed_*' keeps params in float32
# and computes (and outputs, as in Keras) in the half dtype.
POLICY_NAMES: tuple[str, ...] = (
    "float32",
    "float16",
    "bfloat16",
    "float64",
    "mixed_float16",
    "mixed_bfloat16",
    "mixed_fp8",
    "mixed_fp8_current",
)

# FP8 names: float32 params, bfloat16 compute and output, FP8 matmuls (jaxamp.fp8).
_FP8_NAMES = {"mixed_fp8": "delayed", "mixed_fp8_current": "current"}

# jmp's dtype tokens (jmp/_src/policy.py), 'half' resolved per backend as jmp does.
_DTYPE_TOKENS = {
    "bf16": jnp.bfloat16,
    "bfloat16": jnp.bfloat16,
    "f16": jnp.float16,
    "float16": jnp.float16,
    "full": jnp.float32,
    "f32": jnp.float32,
    "float32": jnp.float32,
    "f64": jnp.float64,
    "float64": jnp.float64,
}
_KEYS = {"p": "params", "params": "params", "c": "compute", "compute": "compute",
         "o": "output", "output": "output", "fp8": "fp8"}

_SUPPORTED = (np.dtype(jnp.float16), np.dtype(jnp.bfloat16), _FLOAT32, np.dtype(jnp.float64))

# Common spellings of the names, for "did you mean" (torch/numpy habits).
_ALIASES = {"fp16": "float16", "fp32": "float32", "fp64": "float64", "bf16": "bfloat16",
            "f16": "float16", "f32": "float32", "f64": "float64", "half": "float16",
            "float": "float32", "single": "float32", "double": "float64",
            "brain_float16": "bfloat16", "bfloat": "bfloat16", "amp": "mixed_float16",
            "mixed": "mixed_bfloat16", "mixed_precision": "mixed_bfloat16",
            "fp8": "mixed_fp8", "f8": "mixed_fp8", "float8": "mixed_fp8",
            "float8_e4m3fn": "mixed_fp8", "float8_e5m2": "mixed_fp8"}


def _all_names() -> tuple[str, ...]:
  """The built-in policy names and those registered scaled formats add."""
  return POLICY_NAMES + tuple(n for n in scaled.policy_names() if n not in POLICY_NAMES)


def _valid() -> str:
  return (f"Valid: {', '.join(repr(n) for n in _all_names())}, or a jmp string such as "
          "'p=f32,c=bf16' (params, compute, output, fp8); see help(jaxamp.get_policy).")


def _did_you_mean(spec: str, choices: Any = None) -> str:
  """`` Did you mean 'x'?`` for a near miss of one of ``choices`` (default: the policy
  names, registered ones included), else ``''``."""
  choices = _all_names() if choices is None else choices
  s = spec.strip().lower().replace("-", "_").replace(" ", "_")
  mixed = s.startswith("mixed_")
  body = s[len("mixed_"):] if mixed else s
  body = _ALIASES.get(body, body)
  guess = ("mixed_" + body) if mixed and body in ("float16", "bfloat16") else body
  if guess in choices and guess != spec:
    return f" Did you mean {guess!r}?"
  close = difflib.get_close_matches(s, choices, n=1, cutoff=0.6)
  return f" Did you mean {close[0]!r}?" if close and close[0] != spec else ""


def _unknown(spec: Any, why: str | None = None) -> ValueError:
  hint = _did_you_mean(spec) if isinstance(spec, str) else ""
  why = why or f"Unknown policy {spec!r}."
  return ValueError(f"{why}{hint} {_valid()}")


def _is_array(value: Any) -> bool:
  return isinstance(value, (jax.Array, np.ndarray, np.generic))


def _is_python_type(value: Any) -> bool:
  # By identity: np.dtype('float64') == float is True.
  return any(value is t for t in (float, int, complex, bool))


def _to_dtype(value: Any, what: str) -> np.dtype:
  if value is None:
    raise ValueError(f"{what} must be a floating dtype, got None.")
  if _is_array(value):  # np.dtype(array) quietly means the array's dtype
    raise ValueError(f"{what} must be a dtype, got an array of shape {value.shape}; pass "
                     "its .dtype if you mean that.")
  if _is_python_type(value):  # np.dtype(float) is float64
    raise ValueError(f"{what} must be a dtype, got Python's {value.__name__}; name one: "
                     "jnp.float32, jnp.bfloat16, jnp.float16.")
  try:
    dtype = np.dtype(value)
  except TypeError as e:
    raise ValueError(f"{what} must be a floating dtype, got {value!r}.") from e
  if not jnp.issubdtype(dtype, jnp.floating):
    raise ValueError(
        f"{what} must be a floating dtype (float16, bfloat16, float32, float64), got {dtype}.")
  if dtype not in _SUPPORTED:
    raise ValueError(
        f"{what} cannot be {dtype}: policies take float16, bfloat16, float32 or float64. "
        "8-bit floats need scaling, which a policy dtype cannot give: for FP8 "
        "matmuls use the FP8 mode, get_policy('mixed_fp8') (delayed scaling) or "
        "'mixed_fp8_current', or Policy(jnp.float32, jnp.bfloat16, fp8=jaxamp.DelayedScaling()); "
        "parameters stay float32.")
  if dtype == np.dtype(jnp.float64) and not jax.config.jax_enable_x64:
    raise ValueError(f"{what} float64 needs 64-bit JAX, which is off (arrays would silently "
                     "be float32): call jax.config.update('jax_enable_x64', True) first.")
  return dtype


@dataclasses.dataclass(frozen=True, init=False)
class Policy:
  """An immutable mixed-precision policy: param, compute and output dtypes.

  Hashable and compared by value, so it can be a static argument to ``jax.jit``.

  Args:
    param_dtype: dtype parameters are stored in.
    compute_dtype: dtype matmuls and convolutions run in; defaults to ``param_dtype``.
    output_dtype: dtype a module returns; defaults to ``compute_dtype``.
    fp8: None, or an FP8 recipe (:class:`jaxamp.DelayedScaling`,
      :class:`jaxamp.CurrentScaling`, ``'delayed'``, ``'current'``): the matmuls of
      Linear/Dense layers then run in FP8 (:mod:`jaxamp.fp8`), the rest in
      ``compute_dtype``. It takes the recipe of any scaled format registered with
      :func:`jaxamp.scaled.register` (the layers then run that format's matmul).

  Example:
    >>> import jax.numpy as jnp
    >>> from jaxamp import Policy
    >>> p = Policy(jnp.float32, jnp.bfloat16)
    >>> p.name, p.cast_to_compute(jnp.ones(2)).dtype
    ('mixed_bfloat16', dtype(bfloat16))
  """

  param_dtype: np.dtype
  compute_dtype: np.dtype
  output_dtype: np.dtype
  fp8: Any = None

  def __init__(self, param_dtype: Any, compute_dtype: Any = None, output_dtype: Any = None,
               fp8: Any = None):
    param = _to_dtype(param_dtype, "param_dtype")
    compute = param if compute_dtype is None else _to_dtype(compute_dtype, "compute_dtype")
    output = compute if output_dtype is None else _to_dtype(output_dtype, "output_dtype")
    if fp8 is not None:
      fp8 = recipes.check_recipe(fp8)
      if compute == np.dtype(jnp.float64):
        raise ValueError("An FP8 policy cannot compute in float64: FP8 matmuls accumulate in "
                         "float32. Use compute_dtype bfloat16 (as 'mixed_fp8'), float16 or "
                         "float32.")
    object.__setattr__(self, "param_dtype", param)
    object.__setattr__(self, "compute_dtype", compute)
    object.__setattr__(self, "output_dtype", output)
    object.__setattr__(self, "fp8", fp8)

  @property
  def name(self) -> str:
    """The canonical name: a Keras name where one applies, else a jmp string.

    ``get_policy(p.name) == p`` holds for every policy except FP8 ones with a
    non-default recipe (``DelayedScaling(amax_history_len=16)``), named by its repr.
    """
    p, c, o = self.param_dtype, self.compute_dtype, self.output_dtype
    if self.fp8 is not None:
      return _fp8_name(self)
    if p == c == o:
      return p.name
    if p == _FLOAT32 and dtypes.is_half(c) and o == c:
      return f"mixed_{c.name}"
    return f"params={p.name},compute={c.name},output={o.name}"

  @property
  def is_mixed(self) -> bool:
    """Whether compute runs in a half dtype (float16 or bfloat16)."""
    return dtypes.is_half(self.compute_dtype)

  def __repr__(self) -> str:
    fp8 = "" if self.fp8 is None else f", fp8={self.fp8!r}"
    return (f"Policy(param_dtype='{self.param_dtype.name}', "
            f"compute_dtype='{self.compute_dtype.name}', "
            f"output_dtype='{self.output_dtype.name}'{fp8})")

  def __str__(self) -> str:
    return self.name

  def cast_to_param(self, tree: Any) -> Any:
    """Casts the floating leaves of ``tree`` to ``param_dtype``."""
    return cast_floating(tree, self.param_dtype)

  def cast_to_compute(self, tree: Any) -> Any:
    """Casts the floating leaves of ``tree`` to ``compute_dtype``."""
    return cast_floating(tree, self.compute_dtype)

  def cast_to_output(self, tree: Any) -> Any:
    """Casts the floating leaves of ``tree`` to ``output_dtype``."""
    return cast_floating(tree, self.output_dtype)

  def with_param_dtype(self, dtype: Any) -> Policy:
    """A copy with ``param_dtype`` replaced."""
    return Policy(dtype, self.compute_dtype, self.output_dtype, self.fp8)

  def with_compute_dtype(self, dtype: Any) -> Policy:
    """A copy with ``compute_dtype`` replaced."""
    return Policy(self.param_dtype, dtype, self.output_dtype, self.fp8)

  def with_output_dtype(self, dtype: Any) -> Policy:
    """A copy with ``output_dtype`` replaced."""
    return Policy(self.param_dtype, self.compute_dtype, dtype, self.fp8)

  def with_fp8(self, recipe: Any) -> Policy:
    """A copy whose Linear/Dense matmuls run in FP8 under ``recipe`` (None: no FP8)."""
    return Policy(self.param_dtype, self.compute_dtype, self.output_dtype, recipe)

  def to_jmp(self) -> Any:
    """The equivalent ``jmp.Policy``."""
    import jmp  # pylint: disable=g-import-not-at-top

    # jmp keys its names by the jnp scalar types (jnp.float32), not numpy dtypes.
    return jmp.Policy(param_dtype=getattr(jnp, self.param_dtype.name),
                      compute_dtype=getattr(jnp, self.compute_dtype.name),
                      output_dtype=getattr(jnp, self.output_dtype.name))


PolicyLike = Union[Policy, str, Any]


def _fp8_name(policy: Policy) -> str:
  recipe = policy.fp8
  token = ("delayed" if recipe == recipes.DelayedScaling() else
           "current" if recipe == recipes.CurrentScaling() else repr(recipe))
  base = (policy.param_dtype, policy.compute_dtype, policy.output_dtype)
  if base == (_FLOAT32, np.dtype(jnp.bfloat16), np.dtype(jnp.bfloat16)):
    for name, kind in _FP8_NAMES.items():
      if kind == token:
        return name
    if scaled.policy_name(recipe) is not None:
      return scaled.policy_name(recipe)
  return (f"params={base[0].name},compute={base[1].name},output={base[2].name},"
          f"fp8={token}")


def _half_dtype() -> Any:
  return jnp.bfloat16 if jax.default_backend() == "tpu" else jnp.float16


def _parse_token(token: str, spec: str) -> Any:
  token = token.strip()
  if token == "half":
    return _half_dtype()
  if token.startswith(("float8", "f8", "fp8")):
    if "=" not in spec:
      raise _unknown(spec, f"{spec!r}: 8-bit floats need scaling: an FP8 policy.")
    raise ValueError(f"Policy {spec!r} asks for {token}: 8-bit floats need scaling, "
                     "which a policy dtype cannot give. For FP8 matmuls use 'mixed_fp8' "
                     "(delayed scaling), 'mixed_fp8_current', or add fp8=delayed / "
                     "fp8=current to a policy string ('p=f32,c=bf16,fp8=delayed').")
  try:
    return _DTYPE_TOKENS[token]
  except KeyError:
    tokens = (*_DTYPE_TOKENS, "half")
    if "=" not in spec:
      raise _unknown(spec) from None
    raise ValueError(f"Unknown dtype {token!r} in policy {spec!r}."
                     f"{_did_you_mean(token, tokens)} Dtypes: {', '.join(tokens)}.") from None


def _parse_string(spec: str) -> Policy:
  s = spec.strip()
  if s in _FP8_NAMES:
    return Policy(jnp.float32, jnp.bfloat16, jnp.bfloat16, _FP8_NAMES[s])
  if scaled.policy_recipe(s) is not None:  # a scaled format's policy name
    return Policy(jnp.float32, jnp.bfloat16, jnp.bfloat16, scaled.policy_recipe(s))
  if s.startswith("mixed_"):
    half = s[len("mixed_"):]
    if half in ("float16", "bfloat16"):
      return Policy(jnp.float32, half, half)
    raise _unknown(spec)
  if "=" not in s:
    dtype = _parse_token(s, spec)
    return Policy(dtype, dtype, dtype)
  found: dict[str, Any] = {}
  for part in s.split(","):
    key, sep, value = part.partition("=")
    key = key.strip()
    if not sep or key not in _KEYS:
      raise _unknown(spec, f"Cannot parse {part.strip()!r} in policy {spec!r}: keys are "
                     "params (p), compute (c), output (o), fp8.")
    if _KEYS[key] in found:
      raise ValueError(f"Policy {spec!r} sets {_KEYS[key]} twice; give each of params (p), "
                       "compute (c), output (o) at most once.")
    if _KEYS[key] == "fp8":
      if value.strip() not in ("delayed", "current") and scaled.recipe_named(
          value.strip()) is None:
        takes = dict.fromkeys(("delayed", "current") + scaled.recipe_names())
        raise ValueError(f"Unknown FP8 recipe {value.strip()!r} in policy {spec!r}: fp8= "
                         f"takes {', '.join(repr(n) for n in takes)}.")
      found["fp8"] = value.strip()
      continue
    found[_KEYS[key]] = _parse_token(value, spec)
  return Policy(found.get("params", jnp.float32), found.get("compute"), found.get("output"),
                found.get("fp8"))


def get_policy(spec: PolicyLike) -> Policy:
  """Returns the :class:`Policy` that ``spec`` names.

  Args:
    spec: a ``Policy``; a Keras name (``'float32'``, ``'float16'``, ``'bfloat16'``,
      ``'float64'``, ``'mixed_float16'``, ``'mixed_bfloat16'``); an FP8 name
      (``'mixed_fp8'``: delayed scaling, ``'mixed_fp8_current'``: current scaling; both
      float32 params and bfloat16 for all but the FP8 matmuls, see :mod:`jaxamp.fp8`);
      a jmp string such as ``'params=float32,compute=bfloat16,output=float32'`` or
      ``'p=f32,c=bf16'`` (jmp's defaults for missing keys; ``fp8=delayed`` or
      ``fp8=current`` adds FP8 matmuls); a ``jmp.Policy``; or a floating dtype.

  Returns:
    The policy.

  Raises:
    ValueError: ``spec`` names no policy (the message lists what is valid and suggests
      a near miss: ``'fp16'`` -> ``'float16'``); a key is given twice; a dtype is not
      float16, bfloat16, float32 or float64 (8-bit floats are refused with a pointer to
      the FP8 names), or float64 while
      ``jax_enable_x64`` is off; ``spec`` is an array or a Python type.

  Example:
    >>> import jaxamp, jax.numpy as jnp
    >>> jaxamp.get_policy(jnp.bfloat16).name
    'bfloat16'
  """
  _unread.read()  # a jaxamp API is in use: the global-policy warning is moot
  if isinstance(spec, Policy):
    return spec
  if spec is None:  # np.dtype(None) would quietly mean float64
    raise _unknown(spec, "Cannot make a policy from None.")
  if isinstance(spec, str):
    return _parse_string(spec)
  if all(hasattr(spec, a) for a in ("param_dtype", "compute_dtype", "output_dtype")):  # jmp
    return Policy(spec.param_dtype, spec.compute_dtype, spec.output_dtype)
  if _is_array(spec) or _is_python_type(spec) or isinstance(spec, (int, float, complex)):
    kind = ("an array" if _is_array(spec) else
            f"Python's {spec.__name__}" if isinstance(spec, type) else repr(spec))
    raise _unknown(spec, f"Cannot make a policy from {kind}.")
  try:
    dtype = np.dtype(spec)
  except TypeError:
    raise _unknown(spec, f"Cannot make a policy from {spec!r}.") from None
  if not jnp.issubdtype(dtype, jnp.floating):
    raise _unknown(spec, f"Cannot make a policy from non-floating dtype {dtype}.")
  return Policy(dtype, dtype, dtype)


# --- global policy and scopes -------------------------------------------------------

class _UnreadGlobalPolicy:
  """Warns once when a half-precision global policy was set and JAX traces a program
  of the user's before any jaxamp API has read the policy (a plain Flax model ignores
  it). Listens to JAX's public trace events (``jax.monitoring``): a jitted function's
  trace names the function, an eager operation's names its primitive; JAX's and
  Flax's own helpers (primitives, ``jax.numpy``/``jax.random``/``jax.nn``/``jax.lax``
  functions, private names) are not the user's program."""

  EVENT = "/jax/core/compile/jaxpr_trace_duration"
  MATMULS = frozenset({"dot_general", "conv_general_dilated"})

  def __init__(self):
    self.policy: Policy | None = None  # set and not read since
    self._registered = False
    self._library_names: frozenset[str] | None = None

  def watch(self, policy: Policy) -> None:
    self.policy = policy if policy.compute_dtype != _FLOAT32 else None
    if self.policy is not None and not self._registered:
      self._registered = True
      jax.monitoring.register_event_duration_secs_listener(self._on_event)

  def read(self) -> None:
    self.policy = None

  def _is_users(self, name: str) -> bool:
    if name in self.MATMULS:  # an eager matmul: a model called outside jit
      return True
    if self._library_names is None:
      from jax.extend.core import Primitive  # pylint: disable=g-import-not-at-top
      import jax.extend.core.primitives as prims  # pylint: disable=g-import-not-at-top

      names = {getattr(prims, n).name for n in dir(prims)
               if isinstance(getattr(prims, n), Primitive)}
      for module in (jnp, jax.nn, jax.random, jax.lax, jax.numpy.linalg):
        names.update(dir(module))
      self._library_names = frozenset(names | {"stage"})
    return not (name.startswith(("_", "<")) or name in self._library_names)

  def _on_event(self, event: str, duration: float, **kwargs: Any) -> None:
    del duration
    policy, name = self.policy, kwargs.get("fun_name")
    if policy is None or event != self.EVENT or not name or not self._is_users(name):
      return
    self.policy = None
    what = ("an eager matmul" if name in self.MATMULS
            else f"the jitted function {name!r}")
    _warn_once.warn_once(
        ("policy.global_unread", policy.name),
        f"jaxamp: the global policy is {policy.name!r}, but JAX traced {what} before "
        "any jaxamp API read it. A Flax model called directly (model(x), nnx.jit, "
        "jax.jit) computes in the dtypes its layers were built with, not the global "
        "policy. Add one of: model = jaxamp.nnx.with_policy(model) (Linen: module = "
        "jaxamp.linen.with_policy(module)), which runs it under the policy; or train "
        "with train = jaxamp.make_train_step(loss_fn, optimizer), which also scales "
        "the loss. Loss scaling alone: optax.chain(jaxamp.dynamic_loss_scale(), ...).",
        UserWarning, stacklevel=_outside_libraries())


def _outside_libraries() -> int:
  """The ``stacklevel`` of the innermost caller outside jax, flax and jaxamp (the line of
  the user's that led into this warning)."""
  import os  # pylint: disable=g-import-not-at-top
  import sys  # pylint: disable=g-import-not-at-top

  import flax  # pylint: disable=g-import-not-at-top

  roots = tuple(os.path.dirname(m.__file__) + os.sep for m in (jax, flax)) + (
      os.path.dirname(os.path.abspath(__file__)) + os.sep,)
  frame, level = sys._getframe(1), 1  # pylint: disable=protected-access
  while frame is not None and frame.f_code.co_filename.startswith(roots):
    frame, level = frame.f_back, level + 1
  return level  # as warn_once's stacklevel: 1 names _on_event's line


_unread = _UnreadGlobalPolicy()


_global = get_policy("float32")
_local = threading.local()


def _stack() -> list[Policy]:
  if not hasattr(_local, "stack"):
    _local.stack = []
  return _local.stack


def _fast_path_missing(policy: Policy) -> str | None:
  """Why ``policy``'s compute dtype has no fast path on the default backend, or None."""
  if policy.fp8 is not None:
    return _fp8_fast_path_missing(scaled.format_of(policy.fp8).min_compute_capability)
  if not policy.is_mixed:
    return None
  compute = policy.compute_dtype
  backend = jax.default_backend()
  if backend == "cpu" and compute == np.dtype(jnp.float16):
    return ("XLA on CPU has no fast float16 path (and rejects some float16 dots with "
            "float32 accumulation, e.g. in jax.nn.dot_product_attention); expect float16 to "
            "be slower than float32 here")
  if backend == "gpu":
    cc, major = _compute_capability()
    if major is not None:
      need = 8.0 if compute == np.dtype(jnp.bfloat16) else 7.0
      if major < need:
        return (f"{compute.name} needs a GPU of compute capability >= {need} for Tensor Core "
                f"speed; this one is {cc}")
  return None


def _compute_capability() -> tuple[Any, float | None]:
  """The first device's compute capability as reported (e.g. ``'9.0'``) and as a number
  (None where it reports none or something else)."""
  cc = getattr(jax.devices()[0], "compute_capability", None)
  try:
    return cc, (float(cc) if cc is not None else None)
  except ValueError:
    return cc, None


def _fp8_fast_path_missing(need: float = 8.9) -> str | None:
  """Why FP8 matmuls needing compute capability ``need`` (the format's) run slowly here."""
  gpus = "Ada, Hopper, Blackwell" if need < 9.0 else "Blackwell"
  backend = jax.default_backend()
  if backend == "gpu":
    cc, version = _compute_capability()
    if version is not None and version < need:
      return (f"these FP8 matmuls need a GPU of compute capability >= {need} ({gpus}); "
              f"this one is {cc}, so XLA emulates them")
    return None
  if backend == "cpu":
    return ("XLA on CPU runs FP8 matmuls upcast (FP8's rounding and scaling, for testing); "
            f"FP8 speed needs an NVIDIA GPU of compute capability >= {need}")
  return (f"jaxamp's FP8 mode targets NVIDIA GPUs of compute capability >= {need}; on "
          f"{backend} XLA may run FP8 matmuls upcast")


def _warn_if_slow(policy: Policy, stacklevel: int) -> None:
  key = ("policy.slow", jax.default_backend(), policy.compute_dtype.name,
         policy.fp8 is not None)
  if _warn_once.has_warned(key):  # checked first: this runs on every policy_scope
    return
  reason = _fast_path_missing(policy)
  if reason is not None:
    what = "runs FP8 matmuls" if policy.fp8 is not None else (
        f"computes in {policy.compute_dtype.name}")
    _warn_once.warn_once(key, f"jaxamp: policy {policy.name!r} {what}, "
                         f"but {reason}. It will run correctly, not faster.", RuntimeWarning,
                         stacklevel=stacklevel)


def set_global_policy(spec: PolicyLike) -> None:
  """Sets the process-wide default policy (scopes in any thread take precedence).

  Unlike Keras, where every layer reads the global policy, the global policy here is
  the default of jaxamp's own entry points, which read it when they are called:
  :func:`jaxamp.make_train_step`, :func:`jaxamp.nnx.with_policy`,
  :func:`jaxamp.linen.with_policy`, :func:`jaxamp.autocast`, :func:`jaxamp.summary`,
  :func:`jaxamp.precision_report`, :func:`jaxamp.resolve_policy` and
  :func:`global_policy` itself (each when given no ``policy``). A Flax model called
  directly (``model(x)``, under ``nnx.jit`` or ``jax.jit``) computes in the dtypes its
  layers were built with. So that this does not pass in silence, a half-precision
  global policy that no jaxamp API has read by the time JAX first traces a program of
  yours (a jitted function, or an eager matmul) gives one warning naming what to add.

  Example:
    >>> import jaxamp
    >>> jaxamp.set_global_policy('mixed_bfloat16')
    >>> jaxamp.global_policy().compute_dtype
    dtype(bfloat16)
    >>> jaxamp.set_global_policy('float32')
  """
  global _global
  policy = get_policy(spec)
  _warn_if_slow(policy, stacklevel=3)
  _global = policy
  _unread.watch(policy)


def global_policy() -> Policy:
  """The policy in force: the innermost :func:`policy_scope` of this thread, else the global.

  Example:
    >>> import jaxamp
    >>> jaxamp.global_policy().name
    'float32'
  """
  _unread.read()
  stack = _stack()
  return stack[-1] if stack else _global


@contextlib.contextmanager
def policy_scope(spec: PolicyLike) -> Iterator[Policy]:
  """Makes ``spec`` the policy in force for this thread inside a ``with`` block.

  Scopes nest, are thread-local, and restore the previous policy on exit,
  exceptions included.

  Example:
    >>> import jaxamp
    >>> with jaxamp.policy_scope('mixed_float16') as p:
    ...   p.compute_dtype
    dtype('float16')
  """
  policy = get_policy(spec)
  _warn_if_slow(policy, stacklevel=4)  # generator -> contextlib -> caller
  stack = _stack()
  stack.append(policy)
  try:
    yield policy
  finally:
    stack.pop()
