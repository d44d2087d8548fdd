"""What reverse mode keeps for the backward pass: half-precision values and statistics.

Under a mixed policy, norms and other precision-sensitive pieces compute in float32 on
half-precision inputs. Left to itself, reverse mode then saves their float32
intermediates (the upcast input, the normalised values) and the half-precision copy of
every parameter, and a half-precision conv net can keep *more* for its backward pass
than the float32 one. Fused norm kernels (cuDNN's, torch's) save the half-precision
input and the float32 per-channel statistics instead, and recompute the elementwise
normalisation in the backward pass.

:func:`half_residuals` gets the same for any function, third-party norms included,
without knowing their mathematics: it runs the function under ``jax.checkpoint`` with
the policy :func:`save_half_and_statistics`, which saves what matmuls, convolutions,
reductions and half-precision elementwise operations produce, and recomputes what
cheap elementwise and layout operations make from float32 values and dtype casts
(a parameter's half copy is recast from the float32 parameter; a float16 value's float32
upcast is the one cast saved, see :func:`save_half_and_statistics`). The recomputation is
the same arithmetic on the same values, so the gradients are the ones reverse mode
computes without it (bit for bit where the compiler keeps no excess precision: XLA may
skip a float32 -> bfloat16 -> float32 round trip in one program and not the other).

The train step (``make_train_step``) and ``jaxamp.linen.with_policy`` apply it to every
model that computes in half precision; wrap your own loss with it otherwise:

  >>> import jax, jax.numpy as jnp, jaxamp
  >>> def loss(w, x):  # a float32 layer norm on a bfloat16 matmul's output
  ...   h = (x.astype(jnp.bfloat16) @ w.astype(jnp.bfloat16)).astype(jnp.float32)
  ...   h = (h - h.mean(-1, keepdims=True)) * jax.lax.rsqrt(h.var(-1, keepdims=True) + 1e-5)
  ...   return jnp.sum(jnp.tanh(h))
  >>> w, x = jnp.ones((64, 64)), jnp.ones((32, 64))
  >>> g = jax.grad(jaxamp.half_residuals(loss))(w, x)
  >>> bool(jnp.allclose(g, jax.grad(loss)(w, x), atol=1e-6))
  True
"""

from __future__ import annotations

import functools
import threading
from collections.abc import Callable, Iterable
from typing import Any

import jax
import jax.extend.core as jax_core
import numpy as np

from jaxamp import casting

__all__ = ["computes_in_half", "half_residuals", "recompute_all", "save_half_and_statistics",
           "gathers", "save_all_but_gathers", "regather_policy", "checkpointed"]

# Elementwise and layout primitives: recomputing one costs a pass over memory the
# backward pass makes anyway. Matmuls, convolutions, reductions, scatters, sorts,
# collectives and control flow are not here: what they produce is saved.
_RECOMPUTABLE = frozenset("""
    add sub mul div rem neg abs sign max min pow integer_pow square sqrt rsqrt cbrt
    exp exp2 log log1p expm1 tanh logistic erf erfc erf_inv sin cos tan atan2 sinh cosh
    floor ceil round nextafter clamp select_n is_finite eq ne lt le gt ge and or not
    reduce_precision real imag conj
    broadcast_in_dim reshape transpose squeeze expand_dims rev pad concatenate slice
    dynamic_slice gather copy copy_p
""".split())
_CUSTOM_JVP = frozenset({"custom_jvp_call"})
_MATMULS = frozenset({"dot_general", "conv_general_dilated", "ragged_dot", "ragged_dot_general"})
_GATHERS = frozenset({"all_gather"})
_REMAT = frozenset({"remat2", "checkpoint", "remat"})  # jax.checkpoint's primitive


def _wide_dtype(dtype: Any) -> bool:
  # jax.dtypes.issubdtype knows extended dtypes (typed PRNG keys), which NumPy refuses.
  return (dtype is not None and jax.dtypes.issubdtype(dtype, np.floating)
          and np.dtype(dtype).itemsize >= 4)


def _wide(aval: Any) -> bool:
  return _wide_dtype(getattr(aval, "dtype", None))


_complex: dict[Any, bool] = {}


def _complex_dtype(dtype: Any) -> bool:
  """Whether ``dtype`` is complex (jnp's test: PRNG key dtypes are no NumPy dtype)."""
  if dtype is None:
    return False
  found = _complex.get(dtype)
  if found is None:
    found = _complex[dtype] = bool(jax.numpy.issubdtype(dtype, jax.numpy.complexfloating))
  return found


# Primitives that make complex values from real operands.
_MAKE_COMPLEX = frozenset({"complex", "fft"})


def _makes_complex(prim: Any, avals: tuple[Any, ...], params: dict[str, Any]) -> bool:
  """Whether ``prim`` may output a complex value (any complex operand counts: ``real``
  of one is cheap to recompute). ``jax.checkpoint`` cannot save such a value: it rounds
  each saved residual with ``reduce_precision``, which takes real dtypes only (a
  TypeError in jax 0.10), so the policies here recompute it."""
  if prim.name == "convert_element_type":
    return _complex_dtype(params.get("new_dtype"))
  return prim.name in _MAKE_COMPLEX or any(_complex_dtype(getattr(a, "dtype", None))
                                           for a in avals)


def save_half_and_statistics(prim: Any, *avals: Any, **params: Any) -> bool:
  """A ``jax.checkpoint`` policy: whether reverse mode may save ``prim``'s outputs.

  Not saved (recomputed in the backward pass): dtype casts (but for a float16 value's
  upcast to float32, saved: recomputing those slows XLA:CPU's compile several-fold),
  and elementwise or layout operations (or ``custom_jvp`` functions without a matmul:
  ``relu``, ``gelu``) with a float32 (or wider) operand, and anything with a complex
  operand or result (``jax.checkpoint`` cannot save complex values). Saved: everything
  else, so matmuls, convolutions, reductions (a norm's statistics) and half-precision
  elementwise results.

  Args:
    prim: the primitive.
    *avals: its operands' abstract values.
    **params: its parameters.

  Returns:
    True if its outputs may be saved. A parameter all-gathered where it is read
    (:func:`gathers`) is never saved, nor is what an ``optimization_barrier`` passes
    through (its inputs are: per-layer FSDP ties each layer's parameter slices to its
    inputs with one, and saving its outputs would keep a copy of every slice).
  """
  if _makes_complex(prim, avals, params):
    return False
  if prim.name == "convert_element_type":
    # A float16 value's float32 upcast is saved: recomputed, it made XLA:CPU's compile
    # of a 48-layer float16 LM 6x slower (101 s against 17 s); bfloat16's is recomputed.
    return bool(avals) and getattr(avals[0], "dtype", None) == np.float16 and _wide_dtype(
        params.get("new_dtype"))
  if prim.name in _RECOMPUTABLE or (prim.name in _CUSTOM_JVP
                                    and not _multiplies(params.get("call_jaxpr"))):
    # A custom_jvp function (relu, gelu, softplus) counts as what it computes.
    return not any(_wide(a) for a in avals)
  return not _regathered(prim, params)


def _regathered(prim: Any, params: dict[str, Any]) -> bool:
  """Whether per-layer FSDP needs ``prim``'s outputs recomputed, never saved: a gathered
  parameter (:func:`gathers`), or what an optimization barrier passes through."""
  return gathers(prim, params) or prim.name == "optimization_barrier"


def gathers(prim: Any, params: dict[str, Any]) -> bool:
  """Whether a jaxpr equation all-gathers a parameter where it is read: a
  ``jax.custom_vjp`` function holding an ``all_gather`` (FSDP's per-layer reads,
  ``jaxamp.fsdp(gather='layer')``). Its result is gathered again in the backward pass,
  not saved: saving it would keep every layer's gathered parameters at once."""
  jaxpr = params.get("call_jaxpr")
  return prim.name == "custom_vjp_call" and jaxpr is not None and _holds(jaxpr, _GATHERS)


def save_all_but_gathers(prim: Any, *avals: Any, **params: Any) -> bool:
  """A ``jax.checkpoint`` policy saving everything but parameters all-gathered where they
  are read (:func:`gathers`) and what optimization barriers pass through: the
  full-precision step's policy under per-layer FSDP. Complex values are recomputed
  (:func:`_makes_complex`)."""
  return not (_regathered(prim, params) or _makes_complex(prim, avals, params))


def _multiplies(jaxpr: Any) -> bool:
  """Whether ``jaxpr`` (a Jaxpr or ClosedJaxpr; None: unknown) holds a matmul or
  convolution, at any depth."""
  return jaxpr is None or _holds(jaxpr, _MATMULS)


def _holds(jaxpr: Any, names: frozenset[str]) -> bool:
  """Whether ``jaxpr`` (a Jaxpr or ClosedJaxpr) holds a primitive named in ``names``, at
  any depth."""
  jaxpr = getattr(jaxpr, "jaxpr", jaxpr)
  return any(eqn.primitive.name in names for eqn in jaxpr.eqns) or any(
      _holds(sub, names) for sub in jax_core.subjaxprs(jaxpr))


def recompute_all(prim: Any, *avals: Any, **params: Any) -> bool:
  """A ``jax.checkpoint`` policy saving nothing: the one ``recompute_norms`` runs norms
  under. :func:`half_residuals` knows it, and its own policy takes over (a norm's
  statistics are then saved, not recomputed)."""
  del prim, avals, params
  return False


def _rematerializes(jaxpr: Any) -> bool:
  """Whether ``jaxpr`` holds a ``jax.checkpoint`` (at any depth) other than jaxamp's
  (recomputed norms, per-layer FSDP's modules)."""
  return any(eqn.primitive.name in _REMAT and eqn.params.get("policy") not in _OWN_POLICIES
             for eqn in jaxpr.eqns) or any(
                 _rematerializes(sub) for sub in jax_core.subjaxprs(jaxpr))


def _narrow_reads_seen(jaxpr: Any, outer: list[Any], reads: dict[int, np.dtype]) -> list[Any]:
  """``outer``, each argument read once in half precision and used nowhere else
  (:func:`jaxamp.casting.read_as` inside a train step) marked so that the skip can still
  hold its gradient as the narrow cotangent it is (``casting.narrow_at_boundary``)."""
  if not reads:
    return outer
  uses: dict[int, int] = {}  # by id: Literals are not hashable
  for v in [v for eqn in jaxpr.eqns for v in eqn.invars] + list(jaxpr.outvars):
    uses[id(v)] = uses.get(id(v), 0) + 1
  return [casting.narrow_at_boundary(x, reads[j])
          if j in reads and uses.get(id(jaxpr.invars[j]), 0) == 1 else x
          for j, x in enumerate(outer)]


def regather_policy(compute_dtype: Any) -> Callable[..., bool]:
  """The policy a module reading parameters gathered at their reads (FSDP's
  ``gather='layer'``) runs under: nothing gathered is saved, and the rest as
  :func:`half_residuals` (a module computing in half) or plain reverse mode would save."""
  if np.dtype(compute_dtype).itemsize < 4:
    return save_half_and_statistics
  return save_all_but_gathers


_OWN_POLICIES = (recompute_all, save_half_and_statistics, save_all_but_gathers)


def computes_in_half(policies: Iterable[Any]) -> bool:
  """Whether any of ``policies`` computes narrower than float32 (FP8 included): where
  :func:`half_residuals` has something to save, and the wrappers and the train step
  apply it."""
  return any(p.compute_dtype.itemsize < 4 or p.fp8 is not None for p in policies)


class _Active(threading.local):
  depth = 0


_active = _Active()


def _is_array(x: Any) -> bool:
  return isinstance(x, (jax.Array, np.ndarray, np.generic))


def half_residuals(fn: Callable[..., Any]) -> Callable[..., Any]:
  """``fn`` under ``jax.checkpoint`` with :func:`save_half_and_statistics`.

  Arguments and results may be any pytrees: their arrays go through the checkpoint,
  other leaves (flags, names, Python numbers) are passed as they are. Inside another
  ``half_residuals`` call it is ``fn`` itself (the outer one already applies). A
  function that rematerializes parts of itself (``jax.checkpoint``, ``nn.remat``,
  ``nnx.remat``, at any depth) runs as it is: an outer checkpoint's policy would
  override those of the checkpoints inside it.

  Args:
    fn: the function; a forward pass, or a loss.

  Returns:
    A function of the same arguments returning the same results, whose derivatives
    save half-precision values and statistics rather than float32 intermediates.
  """
  return checkpointed(fn, save_half_and_statistics)


def checkpointed(fn: Callable[..., Any], policy: Callable[..., bool],
                 inspect: Callable[[Any], None] | None = None) -> Callable[..., Any]:
  """``fn`` under ``jax.checkpoint`` with ``policy``, as :func:`half_residuals` runs it
  (pytrees in and out, nested calls and self-rematerializing functions left alone).
  ``inspect``, if given, is called with ``fn``'s jaxpr (its inputs: the array leaves
  of ``(args, kwargs)``, in order) before it runs."""

  @functools.wraps(fn)
  def wrapped(*args: Any, **kwargs: Any) -> Any:
    if _active.depth:
      return fn(*args, **kwargs)
    leaves, treedef = jax.tree.flatten((args, kwargs))
    where = [i for i, x in enumerate(leaves) if _is_array(x)]
    # fn's results' treedef and leaves, the positions of those returned through the
    # checkpoint, of those that are arguments, and the arguments read once in half.
    results: list[Any] = []

    def inner(arrays):
      full = list(leaves)
      for i, x in zip(where, arrays):
        full[i] = x
      a, k = jax.tree.unflatten(treedef, full)
      _active.depth += 1
      try:
        out = fn(*a, **k)
      finally:
        _active.depth -= 1
      found = casting.recording()
      reads = {} if found is None else {
          j: dtype for j, x in enumerate(arrays) if (dtype := found.read_once(x)) is not None}
      out_leaves, out_def = jax.tree.flatten(out)
      # A result that is an argument itself (state a call left alone) is handed back as
      # that argument, not as a copy: callers tell changed state by identity.
      passed = {id(x): j for j, x in enumerate(arrays)}
      same = {i: passed[id(x)] for i, x in enumerate(out_leaves) if id(x) in passed}
      keep = [i for i, x in enumerate(out_leaves) if _is_array(x) and i not in same]
      results[:] = [out_def, out_leaves, keep, same, reads]
      return [out_leaves[i] for i in keep]

    outer = [leaves[i] for i in where]
    # Traced once; the checkpoint then runs the traced program, not fn again.
    closed = jax.make_jaxpr(inner)(outer)
    if inspect is not None:
      inspect(closed.jaxpr)
    out_def, out_leaves, keep, same, reads = results
    run = lambda arrays: jax_core.jaxpr_as_fun(closed)(*arrays)
    inputs = outer
    if not _rematerializes(closed.jaxpr):
      # An outer checkpoint's policy overrides those of the checkpoints inside it: a
      # function that rematerializes itself (nn.remat, jax.checkpoint) keeps its own.
      run = jax.checkpoint(run, policy=policy)
      inputs = _narrow_reads_seen(closed.jaxpr, outer, reads)
    arrays = run(inputs)
    full = list(out_leaves)
    for i, x in zip(keep, arrays):
      full[i] = x
    for i, j in same.items():
      full[i] = outer[j]
    return jax.tree.unflatten(out_def, full)

  return wrapped
