"""Op-level autocast for any JAX function, like ``torch.autocast`` and Apex O1.

:func:`autocast` traces a function to a jaxpr and evaluates it again, equation by
equation, casting each primitive's floating operands as the op lists say
(:mod:`jaxamp.op_lists`): matmuls and convolutions in the policy's compute dtype,
precision-sensitive primitives (``exp``, ``log``, sums, ``rsqrt``, ...) in float32,
bias and residual adds in the compute dtype, other mixed-input primitives at the widest
input type. It works on any function of arrays:
pure ``jax.numpy`` code, loss functions, Flax (Linen ``apply``, NNX through
``nnx.merge``), Equinox or Haiku models.

Because the evaluation binds the same primitives on whatever tracers arrive, the
result composes with ``jax.jit``, ``jax.grad`` (the backward pass is derived from the
cast forward pass, so its matmuls run in the compute dtype too) and ``jax.vmap``, in
either order. Nested jaxprs are handled: ``jit`` calls are inlined, checkpointed
functions are re-checkpointed, ``scan``/``while``/``cond`` bodies are autocast with
their carries kept at the traced dtypes, ``custom_jvp``/``custom_vjp`` functions keep
their rules (their primal, JVP and forward jaxprs are autocast, the types unchanged),
and ``shard_map`` bodies are autocast inside the same mesh.

Example:
  >>> import jax, jax.numpy as jnp
  >>> import jaxamp
  >>> def loss(w, x):
  ...   return jax.nn.logsumexp(jnp.tanh(x @ w), axis=-1).mean()
  >>> w, x = jnp.ones((4, 3)), jnp.ones((2, 4))
  >>> f = jaxamp.autocast(loss, 'mixed_bfloat16')
  >>> f(w, x).dtype, jax.grad(f)(w, x).dtype  # the signature is unchanged
  (dtype('float32'), dtype('float32'))
  >>> 'bf16' in str(jax.make_jaxpr(f)(w, x))  # but the matmul ran in bfloat16
  True
"""

from __future__ import annotations

import contextlib
import functools
import operator
import threading
from collections.abc import Callable, Iterator, Sequence
from typing import Any, NamedTuple, TypeVar

import jax
import jax.extend.linear_util as lu
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.extend import core as jcore
from jax.extend import source_info_util

from jaxamp import _warn_once, dtypes
from jaxamp.op_lists import BFLOAT16_LISTS, CATEGORIES, DEFAULT_LISTS, AutocastLists
from jaxamp.policy import get_policy, global_policy, PolicyLike

__all__ = ["autocast"]

F = TypeVar("F", bound=Callable[..., Any])

_FLOAT32 = np.dtype(jnp.float32)
# What the low-precision and float32 lists may cast: float64 is left alone (as torch
# leaves double tensors), and so are 8-bit floats, which are quantized on purpose.
_ELIGIBLE = frozenset(np.dtype(d) for d in (jnp.float16, jnp.bfloat16, jnp.float32))


class _Context(NamedTuple):
  compute_dtype: np.dtype
  lists: AutocastLists


def autocast(fn: F, policy: PolicyLike | None = None, *,
             lists: AutocastLists | None = None, pinned_argnums: Sequence[int] = ()) -> F:
  """Returns ``fn`` with each primitive run in the precision the op lists give it.

  Matmuls and convolutions run in ``policy.compute_dtype`` (like torch.autocast; XLA
  accumulates half-precision matmuls in float32), ``exp``, ``log`` and other
  range-hungry ops in float32, bias and residual adds in the compute dtype unless their
  float32 operand is pinned (a norm's statistics); :mod:`jaxamp.op_lists` has the
  lists. Integer, boolean and PRNG-key values are never cast.

  The returned function has ``fn``'s signature: same arguments (any pytrees;
  non-array leaves are passed through as static values) and outputs of the same
  structure, shapes and dtypes (floating outputs are cast back to the dtypes ``fn``
  returns), so it drops into ``jax.grad``, ``jax.jit``, ``jax.vmap`` and optimizers.
  Like ``jax.jit`` it is functional: state that ``fn`` mutates in its arguments is
  not written back. For an NNX model, autocast a function of ``nnx.split``'s state
  that merges the model, and return ``nnx.state(model)`` if it updates BatchNorm
  statistics or RNG counters::

    graphdef, state = nnx.split(model)

    @jaxamp.autocast
    def loss_fn(state, batch):
      model = nnx.merge(graphdef, state)
      loss = jnp.mean((model(batch['x']) - batch['y']) ** 2)
      return loss, nnx.state(model)

  Args:
    fn: any function of pytrees of arrays.
    policy: what the low-precision list computes in: anything
      :func:`jaxamp.get_policy` accepts (``'mixed_bfloat16'``, ``jnp.float16``, ...).
      None takes the policy in force now (:func:`jaxamp.global_policy`), as Keras
      layers do when they are built; a later scope does not change it, so ``jax.jit``'s
      cached traces stay valid.
    lists: the op lists; default :data:`jaxamp.op_lists.BFLOAT16_LISTS` for bfloat16
      compute, else :data:`jaxamp.op_lists.DEFAULT_LISTS`.
    pinned_argnums: positional arguments whose float32 values are data, pinned in
      float32: a half value they meet in a follow-compute op (``pred - target``) is
      widened to float32, not they narrowed (as a bias is). Other arguments
      (parameters) follow the compute dtype. ``make_train_step(..., opt_level='O1')``
      pins the batch, so a loss against float32 targets is computed in float32.

  Returns:
    The autocast function.

  Example:
    >>> import jax, jax.numpy as jnp, jaxamp
    >>> f = jaxamp.autocast(lambda x, w: jnp.exp(x @ w), jnp.float16)
    >>> print(jax.make_jaxpr(f)(jnp.ones((1, 2)), jnp.ones((2, 2))))
    { lambda ; a:f32[1,2] b:f32[2,2]. let
        c:f16[1,2] = convert_element_type[new_dtype=float16 weak_type=False] a
        d:f16[2,2] = convert_element_type[new_dtype=float16 weak_type=False] b
        e:f16[1,2] = dot_general[
          dimension_numbers=(([1], [0]), ([], []))
          preferred_element_type=float16
        ] c d
        f:f32[1,2] = convert_element_type[new_dtype=float32 weak_type=False] e
        g:f32[1,2] = exp f
      in (g,) }
  """
  resolved = get_policy(global_policy() if policy is None else policy)
  if resolved.fp8 is not None:
    raise ValueError(f"autocast does not run FP8 (policy {resolved.name!r}): FP8 needs "
                     "per-tensor state, which Linear/Dense layers keep. Use "
                     "jaxamp.make_train_step or jaxamp.nnx/linen.with_policy with it, or "
                     "autocast with 'mixed_bfloat16'.")
  compute = np.dtype(resolved.compute_dtype)
  if lists is None:
    lists = BFLOAT16_LISTS if compute == np.dtype(jnp.bfloat16) else DEFAULT_LISTS
  if not isinstance(lists, AutocastLists):
    raise TypeError(f"lists must be a jaxamp.AutocastLists, got {type(lists).__name__}.")
  ctx = _Context(compute, lists)
  pinned = frozenset(operator.index(i) for i in pinned_argnums)

  @functools.wraps(fn)
  def autocast_fn(*args, **kwargs):
    leaves, treedef = jax.tree.flatten((args, kwargs))
    dynamic = [i for i, leaf in enumerate(leaves) if _is_array(leaf)]

    def flat_fn(*values):
      full = list(leaves)
      for i, value in zip(dynamic, values):
        full[i] = value
      a, k = jax.tree.unflatten(treedef, full)
      return fn(*a, **k)

    values = [leaves[i] for i in dynamic]
    # Which leaves belong to a pinned argument: a tree of flags shaped like the inputs.
    flags = jax.tree.leaves((tuple(jax.tree.map(lambda _, i=i: i in pinned, a)
                                   for i, a in enumerate(args)),
                             jax.tree.map(lambda _: False, kwargs)))
    closed, out_shape = jax.make_jaxpr(flat_fn, return_shape=True)(*values)
    outs, _ = _eval_jaxpr(closed.jaxpr, closed.consts, values, ctx,
                          [flags[i] for i in dynamic])
    outs = [_cast_like(x, aval) for x, aval in zip(outs, closed.out_avals)]
    return jax.tree.unflatten(jax.tree.structure(out_shape), outs)

  return autocast_fn  # type: ignore[return-value]


# --- values and casts -------------------------------------------------------------------

def _is_array(x: Any) -> bool:
  return isinstance(x, (jax.Array, np.ndarray, np.generic))


def _dtype(x: Any) -> Any:
  # Not np.dtype(x.dtype): PRNG keys have extended dtypes numpy cannot interpret.
  return x.dtype if hasattr(x, "dtype") else np.result_type(x)


def _is_float(dtype: np.dtype) -> bool:
  return jnp.issubdtype(dtype, jnp.floating)


# One cast per (value, dtype) in a jaxpr: a value read by several equations is converted
# once, as a hand-written cast would be. The cache holds the value itself, so its id
# cannot be reused while the entry lives.
_casts = threading.local()


@contextlib.contextmanager
def _cast_cache() -> Iterator[None]:
  outer = getattr(_casts, "cache", None)
  _casts.cache = {}
  try:
    yield
  finally:
    _casts.cache = outer


def _cast(x: Any, dtype: np.dtype) -> Any:
  if _dtype(x) == dtype:
    return x
  if isinstance(x, (np.ndarray, np.generic)):  # a literal: cast now, emit no convert op
    return np.asarray(x, dtype)
  cache = getattr(_casts, "cache", None)
  if cache is None:
    return lax.convert_element_type(x, dtype)
  key = (id(x), dtype)
  if key not in cache:
    cache[key] = (x, lax.convert_element_type(x, dtype))
  return cache[key][1]


def _cast_like(x: Any, aval: Any) -> Any:
  """``x`` cast to ``aval``'s dtype if both are floating (the contract of a jaxpr)."""
  if _is_float(aval.dtype) and _is_float(_dtype(x)):
    return _cast(x, np.dtype(aval.dtype))
  return x


def _is_weak(atom: Any) -> bool:
  # Scalar literals in a jaxpr are Python constants jax.numpy has already promoted
  # to the other operand's dtype; like weakly typed values they must not widen it.
  return isinstance(atom, jcore.Literal) or getattr(atom.aval, "weak_type", False)


# --- the interpreter --------------------------------------------------------------------

def _eval_jaxpr(jaxpr: jcore.Jaxpr, consts: Sequence[Any], args: Sequence[Any],
                ctx: _Context, pinned_args: Sequence[bool] | None = None
                ) -> tuple[list[Any], list[bool]]:
  """``jax.core.eval_jaxpr`` with autocast: each equation goes through :func:`_eval_eqn`.

  Returns the outputs and, for each, whether it is a float32 value kept in float32 on
  purpose (*pinned*, see :func:`_follow_compute`). ``pinned_args`` says which ``args``
  are pinned (default: none, like the autocast function's own arguments).
  """
  env: dict[Any, Any] = {}
  pinned: set[Any] = set()  # float32 variables whose float32 is on purpose

  def read(atom: Any) -> Any:
    return atom.val if isinstance(atom, jcore.Literal) else env[atom]

  def is_pinned(atom: Any) -> bool:
    return not isinstance(atom, jcore.Literal) and atom in pinned

  def record(variables: Sequence[Any], values: Sequence[Any], flags: Sequence[bool]) -> None:
    env.update(zip(variables, values))
    pinned.update(v for v, x, flag in zip(variables, values, flags)
                  if flag and _dtype(x) == _FLOAT32)

  env.update(zip(jaxpr.constvars, consts))
  record(jaxpr.invars, args, pinned_args or [False] * len(args))
  with _cast_cache():
    for eqn in jaxpr.eqns:
      name_stack = source_info_util.current_name_stack() + eqn.source_info.name_stack
      with (source_info_util.user_context(eqn.source_info.traceback, name_stack=name_stack),
            eqn.ctx.manager):
        outs, flags = _eval_eqn(eqn, [read(a) for a in eqn.invars],
                                [is_pinned(a) for a in eqn.invars], ctx)
      record(eqn.outvars, outs, flags)
    return [read(a) for a in jaxpr.outvars], [is_pinned(a) for a in jaxpr.outvars]


def _bind(eqn: jcore.JaxprEqn, invals: Sequence[Any], params: dict[str, Any]) -> list[Any]:
  out = eqn.primitive.bind(*invals, **eqn.primitive.get_bind_params(params))
  return list(out) if eqn.primitive.multiple_results else [out]


def _eval_eqn(eqn: jcore.JaxprEqn, invals: list[Any], pinned: list[bool],
              ctx: _Context) -> tuple[list[Any], list[bool]]:
  """One equation under the op lists: its outputs and which of them are pinned."""
  higher_order = _HIGHER_ORDER.get(eqn.primitive.name)
  if higher_order is not None:
    return higher_order(eqn, invals, pinned, ctx)
  category = ctx.lists.resolve(eqn)
  name = eqn.primitive.name
  if (category == "as_traced" and ctx.lists.category(name) is None
      and DEFAULT_LISTS.category(name) is None):  # not one a user removed on purpose
    _warn_unlisted(name, invals)
  pin = any(pinned)  # a value computed from a pinned one stays pinned
  if category == "low_precision":
    return _low_precision(eqn, invals, ctx), [False] * len(eqn.outvars)
  if category == "float32":
    invals = [_cast(x, _FLOAT32) if dtypes.is_half(_dtype(x)) else x for x in invals]
    pin = True
  elif category == "follow_compute":
    invals, followed = _follow_compute(invals, pinned, ctx)
    if not followed:
      invals = _to_widest(eqn, invals)
  elif category == "widest":
    invals = _to_widest(eqn, invals)
  elif category == "as_traced":
    invals = _as_traced(eqn.invars, invals)
    pin = True  # float32 because it was traced so, like a loop's carry
  return _bind(eqn, invals, eqn.params), [pin] * len(eqn.outvars)


def _warn_unlisted(name: str, invals: Sequence[Any]) -> None:
  """Once per primitive: one no list classifies met floating operands (a newer JAX's)."""
  key = ("autocast.unlisted", name)
  if _warn_once.has_warned(key) or not any(_is_float(_dtype(x)) for x in invals):
    return
  _warn_once.warn_once(
      key,
      f"jaxamp.autocast: the primitive {name!r} is in no op list, so it runs at the dtypes "
      f"it was traced with. Classify it with jaxamp.AutocastLists().add({name!r}, "
      f"to=...) (to one of {CATEGORIES}) and pass lists= to autocast.", RuntimeWarning,
      stacklevel=2)


def _low_precision(eqn: jcore.JaxprEqn, invals: list[Any], ctx: _Context) -> list[Any]:
  compute = ctx.compute_dtype
  dtypes = [_dtype(x) for x in invals]
  if not any(_is_float(d) for d in dtypes):
    return _bind(eqn, invals, eqn.params)
  if any(_is_float(d) and d not in _ELIGIBLE for d in dtypes):  # float64, 8-bit floats
    return _bind(eqn, _as_traced(eqn.invars, invals), eqn.params)
  invals = [_cast(x, compute) if _is_float(d) else x for x, d in zip(invals, dtypes)]
  params = eqn.params
  # The result is in the compute dtype, as in torch.autocast and Flax's dtype=. XLA
  # still accumulates in float32 (on CPU a bfloat16 dot of 4096 ones gives 4096, not
  # 256; cuBLAS and TPUs accumulate half matmuls in float32 too). Asking for a float32
  # result (preferred_element_type) instead would make JAX's transpose rule run the
  # backward matmuls in float32: their cotangent would arrive in float32.
  if _is_float(params.get("preferred_element_type") or compute):
    params = {**params, "preferred_element_type": compute}
  return _bind(eqn, invals, params)


def _follow_compute(invals: list[Any], pinned: list[bool], ctx: _Context
                    ) -> tuple[list[Any], bool]:
  """(operands, True) in the compute dtype if the follow-compute rule applies, else
  (``invals``, False).

  It applies when some floating operand is in the compute dtype and every other one is
  a float32 value that is not pinned: a parameter, an input, a value computed from
  them (an embedding lookup), not one a float32-list op produced. So a bias added to a
  matmul's result, a residual stream added to a block's output and a scale multiplied
  into it stay in the compute dtype (torch.autocast's ``addmm`` casts its bias too),
  while ``x - logsumexp(x)`` or ``x * rsqrt(var)`` keep the float32 of their
  statistics.
  """
  compute = ctx.compute_dtype
  floats = [(_dtype(x), p) for x, p in zip(invals, pinned) if _is_float(_dtype(x))]
  if (compute == _FLOAT32 or not any(d == compute for d, _ in floats)
      or not all(d == compute or (d == _FLOAT32 and not p) for d, p in floats)):
    return invals, False
  return [_cast(x, compute) if _is_float(_dtype(x)) else x for x in invals], True


def _to_widest(eqn: jcore.JaxprEqn, invals: list[Any]) -> list[Any]:
  floats = [(_dtype(x), _is_weak(a)) for a, x in zip(eqn.invars, invals) if _is_float(_dtype(x))]
  if len({d for d, _ in floats}) < 2:
    return invals
  strong = [d for d, weak in floats if not weak] or [d for d, _ in floats]
  try:
    target = np.dtype(functools.reduce(jnp.promote_types, strong))
  except jax.dtypes.TypePromotionError:  # no common type (8-bit floats)
    return _as_traced(eqn.invars, invals)
  return [_cast(x, target) if _is_float(_dtype(x)) else x for x in invals]


def _as_traced(atoms: Sequence[Any], invals: Sequence[Any]) -> list[Any]:
  return [_cast_like(x, a.aval) for a, x in zip(atoms, invals)]


# --- higher-order primitives ------------------------------------------------------------

def _autocast_closed(closed: jcore.ClosedJaxpr, ctx: _Context) -> jcore.ClosedJaxpr:
  """``closed`` autocast inside, with exactly its input and output types.

  Its float32 inputs count as pinned: they arrive at the types the function was traced
  with (loop carries, a custom rule's operands), which autocast keeps on purpose, so a
  float32 accumulator carried through a loop is not added to in half precision.
  """

  def run(*args):
    outs, _ = _eval_jaxpr(closed.jaxpr, closed.consts, args, ctx, [True] * len(args))
    return [_cast_like(x, aval) for x, aval in zip(outs, closed.out_avals)]

  debug_info = closed.jaxpr.debug_info
  run.__name__ = getattr(debug_info, "func_name", None) or "autocast"  # names in jaxprs/HLO
  return jax.make_jaxpr(run)(*closed.in_avals)


def _traced_outputs(outs: list[Any]) -> tuple[list[Any], list[bool]]:
  """Outputs of a primitive kept at its traced types: the float32 ones are pinned."""
  return outs, [_dtype(x) == _FLOAT32 for x in outs]


def _inline_call(eqn, invals, pinned, ctx):
  """``jit``/``closed_call``: evaluate the callee in place, at the dtypes that arrive."""
  callee = eqn.params["jaxpr"] if "jaxpr" in eqn.params else eqn.params["call_jaxpr"]
  jaxpr, consts = ((callee.jaxpr, callee.consts) if isinstance(callee, jcore.ClosedJaxpr)
                   else (callee, ()))
  name = eqn.params.get("name")
  with jax.named_scope(name) if name else contextlib.nullcontext():
    return _eval_jaxpr(jaxpr, consts, invals, ctx, pinned)


def _traced_body(jaxpr: jcore.Jaxpr, pinned: list[bool], ctx: _Context):
  """(body, flags): ``body(args)`` autocasts ``jaxpr`` and returns its outputs (for
  ``jax.checkpoint`` and ``shard_map`` to trace); ``flags`` then holds which are pinned."""
  flags: list[bool] = []

  def body(args):
    outs, out_pinned = _eval_jaxpr(jaxpr, (), args, ctx, pinned)
    flags[:] = out_pinned
    return outs

  return body, flags


def _checkpoint(eqn, invals, pinned, ctx):
  """``jax.checkpoint``: re-checkpoint the autocast body with the same policy."""
  params = eqn.params
  body, flags = _traced_body(params["jaxpr"], pinned, ctx)
  outs = list(jax.checkpoint(lambda *a: body(a), prevent_cse=params["prevent_cse"],
                             policy=params["policy"])(*invals))
  return outs, flags


def _control_flow(*jaxpr_params: str):
  """``scan``/``while``/``cond``: autocast bodies, keep carries at the traced dtypes."""

  def rule(eqn, invals, pinned, ctx):
    del pinned  # the bodies see their operands at the traced types, pinned
    params = dict(eqn.params)
    for key in jaxpr_params:
      value = params[key]
      params[key] = (tuple(_autocast_closed(j, ctx) for j in value) if isinstance(value, tuple)
                     else _autocast_closed(value, ctx))
    return _traced_outputs(_bind(eqn, _as_traced(eqn.invars, invals), params))

  return rule


def _wrap_thunk(thunk: Any, ctx: _Context) -> Any:
  """Wraps a custom rule's jaxpr thunk so the jaxpr it returns is autocast (memoized).

  The thunks return ``(jaxpr, consts, *extra)``; the extra outputs are passed on.
  """
  cache: dict[tuple[Any, ...], Any] = {}

  def autocast_thunk(*zeros):
    if zeros not in cache:
      jaxpr, consts, *rest = thunk.call_wrapped(*zeros)
      new = _autocast_closed(jcore.ClosedJaxpr(jaxpr, consts), ctx)
      cache[zeros] = (new.jaxpr, new.consts, *rest)
    return cache[zeros]

  return lu.wrap_init(autocast_thunk, debug_info=thunk.debug_info)


def _custom_jvp(eqn, invals, pinned, ctx):
  """``custom_jvp``: autocast the primal and the JVP rule; AD still uses the rule."""
  del pinned
  params = dict(eqn.params,
                call_jaxpr=_autocast_closed(eqn.params["call_jaxpr"], ctx),
                jvp_jaxpr_fun=_wrap_thunk(eqn.params["jvp_jaxpr_fun"], ctx))
  return _traced_outputs(_bind(eqn, _as_traced(eqn.invars, invals), params))


def _custom_vjp(eqn, invals, pinned, ctx):
  """``custom_vjp``: autocast the primal and the forward rule (residual types unchanged);
  the backward rule runs as written."""
  del pinned
  params = dict(eqn.params,
                call_jaxpr=_autocast_closed(eqn.params["call_jaxpr"], ctx),
                fwd_jaxpr_thunk=_wrap_thunk(eqn.params["fwd_jaxpr_thunk"], ctx))
  return _traced_outputs(_bind(eqn, _as_traced(eqn.invars, invals), params))


def _shard_map(eqn, invals, pinned, ctx):
  """``shard_map``: autocast the body inside the same mesh and specs."""
  params = eqn.params
  body, flags = _traced_body(params["jaxpr"], pinned, ctx)
  mapped = jax.shard_map(lambda *a: tuple(body(a)), mesh=params["mesh"],
                         in_specs=tuple(params["in_specs"]),
                         out_specs=tuple(params["out_specs"]),
                         axis_names=params["newly_manual_axes"],
                         check_vma=params["check_vma"])
  return list(mapped(*invals)), flags


_HIGHER_ORDER: dict[str, Callable[[Any, list[Any], list[bool], _Context],
                                   tuple[list[Any], list[bool]]]] = {
    "jit": _inline_call,
    "closed_call": _inline_call,
    "call": _inline_call,
    "eval_jaxpr": _inline_call,
    "remat2": _checkpoint,
    "scan": _control_flow("jaxpr"),
    "while": _control_flow("cond_jaxpr", "body_jaxpr"),
    "cond": _control_flow("branches"),
    "custom_jvp_call": _custom_jvp,
    "custom_vjp_call": _custom_vjp,
    "shard_map": _shard_map,
}
