"""Per-module mixed-precision policies for unmodified Equinox models.

:func:`with_policy` returns the model as a *policy view*: the same pytree, holding the
same arrays, in which every ``eqx.Module`` is an instance of a cached subclass of its
own class whose ``__call__`` runs under the module's resolved policy
(:func:`jaxamp.resolve_policy`: path rules, then class rules, then the enclosing
module's policy; the model itself takes the model-level policy). Nothing in Equinox is
patched: the subclasses live only in the view, ``isinstance`` checks still hold, and
``jax.vmap``, ``lax.scan`` over ``eqx.combine``-d layers, ``eqx.filter_jit`` and
``jax.grad`` see an ordinary pytree. Inside a module whose compute dtype is ``c``:

- floating arguments are cast to ``c``; integers (token ids), booleans (masks), PRNG
  keys, modules and ``eqx.nn.State`` pass untouched;
- floating array fields read while it runs (its own ``self.weight``, or a
  submodule's, e.g. a tied ``self.embed.weight``) read as ``c``; the stored arrays, and
  their gradients, keep their dtypes. ``eqx.nn.Embedding`` looks rows up in the stored
  table and casts the rows;
- floating outputs are cast to the policy's output dtype.

Norms (``eqx.nn.LayerNorm``, ``RMSNorm``, ``GroupNorm``, ``BatchNorm``) compute in
float32 by the default norm rule. Methods other than ``__call__`` run under the policy
where :data:`POLICY_METHODS` names them. The first call of a view warns once when a
module computing in half precision still runs matmuls in float32 (:mod:`jaxamp.census`),
naming it. ``make_train_step`` trains Equinox models (and other pytrees) through
:class:`jaxamp.adapters.EquinoxAdapter`. Under an FP8 policy (``'mixed_fp8'``) the
matmul of each ``eqx.nn.Linear`` runs as :func:`jaxamp.fp8.scaled_dot_general`, with
its state in the train step's FP8 state as for the Flax layers (under ``jax.vmap`` the
matmul runs once on the whole batch: one scale, the batch's amax).

Example:
  >>> import jax, jax.numpy as jnp, equinox as eqx
  >>> import jaxamp.equinox
  >>> model = eqx.nn.Sequential([eqx.nn.Linear(4, 8, key=jax.random.key(0)),
  ...                            eqx.nn.LayerNorm(8)])
  >>> amp = jaxamp.equinox.with_policy(model, 'mixed_bfloat16')
  >>> amp(jnp.ones(4)).dtype, amp.layers[0].weight.dtype
  (dtype(bfloat16), dtype('float32'))
  >>> [(path, p.compute_dtype.name) for path, _, p in jaxamp.equinox.module_policies(amp)]
  [('', 'bfloat16'), ('layers/0', 'bfloat16'), ('layers/1', 'float32')]
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from typing import Any, NamedTuple

import equinox as eqx
import jax
import numpy as np

from jaxamp import _warn_once
from jaxamp import fp8 as fp8_lib
from jaxamp import module_call
from jaxamp import numerics
from jaxamp import scaled
from jaxamp.casting import at_least_float32, is_floating_array, read_as
from jaxamp.census import module_matmuls
from jaxamp.policy import Policy, PolicyLike, get_policy, global_policy
from jaxamp.rules import path_name, resolve_tree
from jaxamp import gather as gather_lib

__all__ = ["POLICY_METHODS", "with_policy", "module_policies", "unwrap", "view_policy",
           "matmul_census", "is_policy_view"]

# Methods that run under the module's policy, by class (subclasses included). Add your
# own entry points, e.g. POLICY_METHODS[MyModel] = ('__call__', 'encode'); views made
# after the edit see them.
POLICY_METHODS: dict[type, tuple[str, ...]] = {eqx.Module: ("__call__",)}

_INFO = "_jaxamp_info"
_NORMS = (eqx.nn.LayerNorm, eqx.nn.RMSNorm, eqx.nn.GroupNorm)


class _Info(NamedTuple):
  """What a policy class knows: its user class, its policy, the model-level policy of
  the view, the dtype its outputs are handed over in, and its census scope."""

  base: type
  policy: Policy
  model_policy: Policy
  output_dtype: np.dtype
  recompute_norms: bool = False
  scope: int | None = None
  fp8_path: str | None = None  # an FP8 layer's path: its FP8 state's key
  path: str | None = None  # set while the numerics monitor records (jaxamp.numerics)


def _info(module: Any) -> _Info | None:
  return type(module).__dict__.get(_INFO)


def _base_class(cls: type) -> type:
  info = cls.__dict__.get(_INFO)
  return cls if info is None else info.base


def is_policy_view(tree: Any) -> bool:
  """Whether ``tree`` holds a module of a policy view (:func:`with_policy`)."""
  return any(_info(m) is not None for _, m in _walk(tree))


# --- the module walk ---------------------------------------------------------------------


def _is_module(x: Any) -> bool:
  return isinstance(x, eqx.Module)


def _contents(node: Any) -> tuple[list[tuple[tuple[Any, ...], Any]], Any]:
  """``node``'s pytree contents with its submodules as leaves: ``(key path, leaf)`` pairs
  and the treedef that puts them back."""
  return jax.tree_util.tree_flatten_with_path(
      node, is_leaf=lambda x: x is not node and _is_module(x))


def _walk(tree: Any, path: tuple[Any, ...] = ()) -> Iterator[tuple[tuple[Any, ...], Any]]:
  """``(key path, module)`` for every ``eqx.Module`` in ``tree``, parents first; the
  paths are the pytree key paths ``jax.tree_util`` gives the modules' arrays."""
  if _is_module(tree):
    yield path, tree
  for key, leaf in _contents(tree)[0]:
    if _is_module(leaf):
      yield from _walk(leaf, (*path, *key))


def _resolve(model: Any, policy: Policy) -> list[tuple[tuple[Any, ...], Any, Policy]]:
  """``(key path, module, policy)`` for every module of ``model``, parents first."""
  modules = list(_walk(model))
  resolved = resolve_tree([(path, _base_class(type(m))) for path, m in modules], policy)
  return [(path, m, resolved[path]) for path, m in modules]


def _rebuilt(tree: Any, make: Callable[[tuple[Any, ...], Any, bool], type],
             cast: np.dtype | None = None, path: tuple[Any, ...] = (), top: bool = True
             ) -> Any:
  """``tree`` with every module in the class ``make(path, module, top)`` gives it
  (``top``: no module encloses it); with ``cast``, the floating arrays a container root
  holds outside its modules read as ``cast``."""
  flat, treedef = _contents(tree)
  is_module = _is_module(tree)
  leaves = []
  for key, leaf in flat:
    if _is_module(leaf):
      leaf = _rebuilt(leaf, make, cast, (*path, *key), top and not is_module)
    elif cast is not None and not is_module and is_floating_array(leaf):
      leaf = read_as(leaf, cast)
    leaves.append(leaf)
  new = treedef.unflatten(leaves)
  if is_module:
    cls = make(path, tree, top)
    if type(new) is not cls:
      fresh = object.__new__(cls)
      fresh.__dict__.update(new.__dict__)
      new = fresh
  return new


# --- the policy classes ------------------------------------------------------------------


# stack: the compute dtype of each module call running, innermost last (None: reads
# stay as stored, an embedding lookup); census: a census trace is running.
_state = module_call.CallState()


def _policy_class(info: _Info) -> type:
  """A subclass of ``info.base`` whose policy methods run under ``info.policy``; cached,
  except for census classes (one per module, made for one trace)."""
  return _classes.subclass(info.base, {_INFO: info, "__getattribute__": _reading(info.base)},
                           key=info, cache=info.scope is None)


def _reading(base: type) -> Callable[[Any, str], Any]:
  get = base.__getattribute__

  def __getattribute__(self, name: str) -> Any:
    value = get(self, name)
    if gather_lib.is_slice(value):  # FSDP: gathered in the reading module's compute dtype
      return value.unbox()
    if name[0] == "_" or not _state.stack:
      return value
    dtype = _state.stack[-1]
    if dtype is None:
      return value
    if is_floating_array(value):
      return read_as(value, dtype)
    if type(value) in (list, tuple, dict):
      return jax.tree.map(
          lambda x: x.unbox() if gather_lib.is_slice(x)
          else read_as(x, dtype) if is_floating_array(x) else x, value,
          is_leaf=lambda x: _is_module(x) or gather_lib.is_slice(x))
    return value

  return __getattribute__


_LIBRARY = module_call.Library(keep=lambda x: _is_module(x) or isinstance(x, eqx.nn.State))


def _outermost_checked(module: Any, fn: Callable[..., Any], name: str, info: _Info,
                       args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
  if not _state.stack and not _state.census:  # an outermost call
    _check(module, name, args, kwargs)
  return _run_under(module, fn, info, args, kwargs)


# A user's subclass of a policy class (no info of its own) runs as is.
_classes = module_call.PolicyClasses(
    POLICY_METHODS, _info, _outermost_checked,
    lambda base, namespace: type(base)(base.__name__, (base,), namespace))


def _run_under(module: Any, fn: Callable[..., Any], info: _Info, args: tuple[Any, ...],
               kwargs: dict[str, Any]) -> Any:
  compute = info.policy.compute_dtype
  if fn is eqx.nn.Linear.__call__ and fp8_lib.runs_fp8(info.base, info.policy):
    fn = _fp8_linear(info)
  elif fn is eqx.nn.Conv.__call__ and fp8_lib.runs_fp8(info.base, info.policy):
    fn = _fp8_conv(info)
  elif fn is eqx.nn.ConvTranspose.__call__ and fp8_lib.runs_fp8(info.base, info.policy):
    fn = _fp8_conv_transpose(info)
  gather = fn is eqx.nn.Embedding.__call__  # a lookup: keep the table, cast the rows
  sliced = _owns_slices(module)  # FSDP, gather='layer': fields gathered where read

  # Its parameter slices are gathered in its compute dtype, after its inputs (or, under
  # prefetching, the previous reading module's: gather.tie_for).
  tie = gather_lib.tie_for([x for x in jax.tree.leaves((args, kwargs))
                            if is_floating_array(x)]) if sliced else None

  def run(module, args, kwargs, tie):  # the arguments cast
    _state.stack.append(None if gather else compute)
    try:
      with gather_lib.reading(compute, tie):
        return fn(module, *args, **kwargs)
    finally:
      _state.stack.pop()

  def cast_and_run(module, args, kwargs, tie):
    cast = lambda tree: module_call.cast_values(tree, compute, _LIBRARY.keep)
    return run(module, cast(args), cast(kwargs), tie)

  # Recomputed, the cast inside the checkpoint: reverse mode keeps the half-precision
  # input, not the float32 intermediates; or gathered again in the backward pass.
  remat = module_call.remat_for(norm=issubclass(info.base, _NORMS),
                                recompute_norms=info.recompute_norms, owns_slices=sliced,
                                inputs=(args, kwargs), compute=compute, keep=_is_module)
  return module_call.call_under(
      _LIBRARY, info.policy, args, kwargs, call=lambda a, k: run(module, a, k, tie),
      recomputed=lambda r: eqx.filter_checkpoint(cast_and_run, policy=r.policy)(
          module, args, kwargs, tie),
      remat=remat, scope=info.scope, output_dtype=info.output_dtype, path=info.path,
      layer=info.base)


def fp8_classes() -> tuple[type, ...]:
  """The layers whose matmul runs in FP8 under an FP8 policy."""
  return (eqx.nn.Linear, eqx.nn.Conv, eqx.nn.ConvTranspose)


fp8_lib.hook_conv_classes(lambda: (eqx.nn.Conv, eqx.nn.ConvTranspose))


def fp8_rows(model: Any, rows: list[Any]) -> list[Any]:
  """The rows of ``module_policies(model)`` that keep FP8 state: all but layers holding
  a stack of weights (one per step of a ``lax.scan``), which run with current scaling."""
  stacked = {path_name(path) for path, m in _walk(model)
             if (isinstance(m, eqx.nn.Linear) and np.ndim(m.weight) > 2)
             or (isinstance(m, (eqx.nn.Conv, eqx.nn.ConvTranspose))
                 and np.ndim(m.weight) > m.num_spatial_dims + 2)}
  return [row for row in rows if row[0] not in stacked]


def _fp8_linear(info: _Info) -> Callable[..., Any]:
  """``eqx.nn.Linear.__call__`` with its matmul an FP8 dot (:func:`jaxamp.fp8.dot_for`:
  the module's state in the running step, read when the matmul runs)."""

  def call(self, x, *, key=None):
    del key
    dot = fp8_lib.dot_for(info.fp8_path, info.policy.fp8, f"Linear {info.fp8_path}")
    if self.in_features == "scalar":
      x = x.reshape(x.shape + (1,))
    y = _one_matmul_per_batch(dot, info.fp8_path)(x, self.weight)
    if self.bias is not None:
      y = y + self.bias
    return y[..., 0] if self.out_features == "scalar" else y

  return call


def _fp8_conv(info: _Info) -> Callable[..., Any]:
  """``eqx.nn.Conv.__call__`` with its convolution an FP8 one
  (:func:`jaxamp.scaled.conv_for`), run once on a whole batch under ``jax.vmap``."""

  def call(self, x, *, key=None):
    del key
    if x.ndim != self.num_spatial_dims + 1:
      raise ValueError(f"Input to `Conv` needs to have rank {self.num_spatial_dims + 1}, "
                       f"but input has shape {x.shape}.")
    if self.padding_mode != "ZEROS":
      x, padding = self._nonzero_pad(x), "VALID"
    else:
      padding = self.padding
    conv = scaled.conv_for(info.fp8_path, info.policy.fp8, f"Conv {info.fp8_path}")

    def run(x, w):  # x: [N, C, *spatial]
      return conv(x, w, self.stride, padding, rhs_dilation=self.dilation,
                  feature_group_count=self.groups)

    y = _one_conv_per_batch(run, info.fp8_path)(x, self.weight)
    if self.use_bias:
      y = y + self.bias
    return y

  return call


def _fp8_conv_transpose(info: _Info) -> Callable[..., Any]:
  """``eqx.nn.ConvTranspose.__call__`` with its convolution (of the stride-dilated input)
  an FP8 one, run once on a whole batch under ``jax.vmap``, as :func:`_fp8_conv`."""

  def call(self, x, *, key=None):
    del key
    if x.ndim != self.num_spatial_dims + 1:
      raise ValueError(f"Input to `ConvTranspose` needs to have rank "
                       f"{self.num_spatial_dims + 1}, but input has shape {x.shape}.")
    padding = self._padding_transpose()
    if self.padding_mode == "CIRCULAR":
      x, padding = self._circular_pad(x, padding)
    conv = scaled.conv_for(info.fp8_path, info.policy.fp8, f"ConvTranspose {info.fp8_path}")

    def run(x, w):  # x: [N, C, *spatial]
      return conv(x, w, (1,) * self.num_spatial_dims, padding, lhs_dilation=self.stride,
                  rhs_dilation=self.dilation, feature_group_count=self.groups)

    y = _one_conv_per_batch(run, info.fp8_path)(x, self.weight)
    if self.use_bias:
      y = y + self.bias
    return y

  return call


def _one_conv_per_batch(run: Callable[..., Any], path: str) -> Callable[[Any, Any], Any]:
  """One example's convolution (``x``: ``[C, *spatial]``) that, under ``jax.vmap``, runs
  once on the batch (its ``N`` dimension): one scale and amax for the batch, as
  :func:`_one_matmul_per_batch` does for a ``Linear``."""

  def one(x, w):
    return run(x[None], w)[0]

  @jax.custom_batching.custom_vmap
  def batched(x, w):
    return one(x, w)

  @batched.def_vmap
  def _rule(axis_size, in_batched, x, w):
    del axis_size
    scaled.retraced(path)  # this trace replaces the one custom_vmap made of `batched`
    x_mapped, w_mapped = in_batched
    if w_mapped:
      return jax.vmap(one, in_axes=(0 if x_mapped else None, 0))(x, w), True
    return run(x, w), True  # the batch is the convolution's N

  return batched


def _one_matmul_per_batch(dot: Callable[..., Any], path: str) -> Callable[[Any, Any], Any]:
  """``x @ weight.T`` through the FP8 ``dot``, run once on a whole batch under
  ``jax.vmap`` (the usual way to call an Equinox model on a batch).

  Mapped example by example, each example would be quantized with its own scale and
  the amaxes the dot hands back as the state's cotangent would be summed over the
  examples; with the batch folded into the matmul's rows (a ``custom_vmap`` rule) the
  batch is one tensor, as a Flax ``Dense`` sees it: one scale, the batch's amax. A
  weight mapped too (an ensemble) is matmul'd example by example.
  """

  def matmul(x, w):
    return dot(x, w, (((x.ndim - 1,), (1,)), ((), ())))

  @jax.custom_batching.custom_vmap
  def batched(x, w):
    return matmul(x, w)

  @batched.def_vmap
  def _rule(axis_size, in_batched, x, w):
    del axis_size
    scaled.retraced(path)  # this trace replaces the one custom_vmap made of `batched`
    x_mapped, w_mapped = in_batched
    if w_mapped:
      return jax.vmap(matmul, in_axes=(0 if x_mapped else None, 0))(x, w), True
    # The batch folded into the rows (a vmap around this one maps it example by example).
    return matmul(x, w), True

  return batched


def _owns_slices(module: Any) -> bool:
  """Whether a field of ``module`` holds a parameter slice gathered where read (FSDP):
  the field itself, or a list, tuple or dict in it, the fields ``_reading`` unboxes (a
  submodule's slices are its own). Called on every module call: fields of other types
  are not flattened."""
  stop = lambda x: _is_module(x) or gather_lib.is_slice(x)
  return any(gather_lib.is_slice(value) or (
      type(value) in (list, tuple, dict)
      and any(map(gather_lib.is_slice, jax.tree.leaves(value, is_leaf=stop))))
             for value in module.__dict__.values())


# --- views ---------------------------------------------------------------------------------


def _view(model: Any, policy: Policy, *, float32_outputs: bool = False,
          recompute_norms: bool = False) -> Any:
  """The policy view of ``model`` (a plain model or a view). ``float32_outputs``: the
  outermost modules hand their outputs over in at least float32 of their output dtype
  (default: in their output dtype)."""
  policies = {path: p for path, _, p in _resolve(model, policy)}

  def make(path: tuple[Any, ...], module: Any, top: bool) -> type:
    base = _base_class(type(module))  # every module: its fields read as the reader computes
    p = policies[path]
    out = at_least_float32(p.output_dtype) if top and float32_outputs else p.output_dtype
    fp8_path = path_name(path) if fp8_lib.runs_fp8(base, p) else None
    watched = path_name(path) if numerics.current() is not None else None
    return _policy_class(_Info(base, p, policy, np.dtype(out), bool(recompute_norms),
                               fp8_path=fp8_path, path=watched))

  return _rebuilt(model, make, cast=policy.compute_dtype)


def unwrap(model: Any) -> Any:
  """``model`` with every module of a policy view back in its own class (a plain model
  with the same arrays); a plain model as it is."""
  if not is_policy_view(model):
    return model
  return _rebuilt(model, lambda path, m, top: _base_class(type(m)))


def view_policy(model: Any) -> Policy | None:
  """The model-level policy of a policy view, or None for a plain model."""
  for _, m in _walk(model):
    info = _info(m)
    if info is not None:
      return info.model_policy
  return None


def with_policy(model: Any, policy: PolicyLike | None = None, *,
                recompute_norms: bool = False, float32_outputs: bool = False) -> Any:
  """Returns ``model`` with every module running under its resolved policy.

  Args:
    model: an ``eqx.Module``, unmodified (or a pytree holding modules: its own floating
      arrays, outside every module, are handed over in the compute dtype). A view is
      made again under ``policy``.
    policy: the model-level policy (anything :func:`jaxamp.get_policy` accepts); None
      takes :func:`jaxamp.global_policy` now, once.
    recompute_norms: recompute ``eqx.nn.LayerNorm``, ``RMSNorm`` and ``GroupNorm`` in
      the backward pass when they compute wider than their inputs: less activation
      memory, more time. Off by default.
    float32_outputs: the outermost modules hand their floating outputs over in float32
      (what ``make_train_step``'s ``loss_fn`` gets) rather than their output dtype; a
      wider output dtype (float64) is kept.

  Returns:
    The policy view: a pytree of the same arrays; call it (or ``jax.vmap`` it) in place
    of ``model``. :func:`unwrap` gives the plain model back.

  Example:
    >>> import jax, jax.numpy as jnp, equinox as eqx, jaxamp.equinox
    >>> mlp = eqx.nn.MLP(4, 2, 8, depth=2, key=jax.random.key(0))
    >>> amp = jaxamp.equinox.with_policy(mlp, 'mixed_float16')
    >>> jax.vmap(amp)(jnp.ones((3, 4))).dtype, isinstance(amp, eqx.nn.MLP)
    (dtype('float16'), True)
  """
  policy = global_policy() if policy is None else get_policy(policy)
  return _view(model, policy, recompute_norms=recompute_norms,
               float32_outputs=float32_outputs)


def module_policies(model: Any, policy: PolicyLike | None = None
                    ) -> list[tuple[str, type, Policy]]:
  """The policy every module of ``model`` runs under.

  Args:
    model: an ``eqx.Module`` (or a pytree holding modules), or a policy view.
    policy: the model-level policy; None means the view's, else
      :func:`jaxamp.global_policy`.

  Returns:
    ``(path, class, policy)`` for every module, parents first; paths are ``'/'``-joined
    pytree key paths (``'blocks/0/attn'``) and the model's own is ``''``. A model that
    is not a module itself gets a row ``('', type(model), policy)`` for the arrays it
    holds outside its modules.

  Example:
    >>> import jax, equinox as eqx, jaxamp.equinox
    >>> mlp = eqx.nn.MLP(2, 2, 4, depth=1, key=jax.random.key(0))
    >>> for path, cls, p in jaxamp.equinox.module_policies(mlp, 'mixed_float16'):
    ...   print(repr(path), cls.__name__, p.name)
    '' MLP mixed_float16
    'layers/0' Linear mixed_float16
    'layers/1' Linear mixed_float16
  """
  if policy is None:
    policy = view_policy(model) or global_policy()
  policy = get_policy(policy)
  rows = [(path_name(path), _base_class(type(m)), p) for path, m, p in _resolve(model, policy)]
  if not _is_module(model):
    rows.insert(0, ("", type(model), policy))
  return rows


# --- did the policy reach the matmuls? -----------------------------------------------------


def matmul_census(model: Any, *args: Any, policy: PolicyLike | None = None,
                  method: str = "__call__", **kwargs: Any
                  ) -> tuple[list[Any], list[str], dict[str, Policy]]:
  """Which module each matmul of a call runs in, and in which dtypes.

  Nothing runs: the call is traced with ``jax.make_jaxpr``.

  Args:
    model: an ``eqx.Module`` or a policy view.
    *args: the call's arguments (arrays or ``jax.ShapeDtypeStruct``).
    policy: the model-level policy; None: the view's, else the global policy.
    method: the method to call.
    **kwargs: its keyword arguments.

  Returns:
    ``(ops, modules, policies)``: the :func:`jaxamp.census.module_matmuls` census, the
    ``'/'``-joined module path of each scope number, and each module's policy by path.
  """
  if policy is None and is_policy_view(model):
    view = model
  else:
    view = with_policy(model, view_policy(model) if policy is None else policy)
  ops, names = _census(view, method, args, kwargs)
  return ops, names, {path: p for path, _, p in module_policies(view)}


def _census(view: Any, name: str, args: tuple[Any, ...], kwargs: dict[str, Any]
            ) -> tuple[list[Any], list[str]]:
  """The census of ``view``'s ``name`` call: each module under a named scope."""
  view = gather_lib.whole(view)  # FSDP slices as whole parameters' shapes
  modules = list(_walk(view))
  scopes = {path: i for i, (path, _) in enumerate(modules)}
  arrays, static = eqx.partition(
      (view, args, kwargs), lambda x: eqx.is_array(x) or isinstance(x, jax.ShapeDtypeStruct))

  def scoped(path: tuple[Any, ...], module: Any, top: bool) -> type:
    info = _info(module)
    return type(module) if info is None else _policy_class(info._replace(scope=scopes[path]))

  def run(arrays):
    v, a, k = eqx.combine(arrays, static)
    out = getattr(_rebuilt(v, scoped), name)(*a, **k)
    return [x for x in jax.tree.leaves(out) if eqx.is_array(x)]

  _state.census = True
  try:
    with fp8_lib.suspended():  # inside a step: the abstract pass records no FP8 use
      jaxpr = jax.make_jaxpr(run)(arrays)
  finally:
    _state.census = False
  return module_matmuls(jaxpr), [path_name(path) for path, _ in modules]


_checked: set[Any] = set()


def _check(view: Any, name: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
  """Warns once if a module computing in half by policy leaves matmuls in float32;
  checked once per model class, policy, method and input shapes."""
  info = _info(view)
  key = (info.base, info.model_policy, name,
         module_call.input_signature(jax.tree.leaves((args, kwargs))))
  if not module_call.first_time(_checked, key):
    return
  infos = {path_name(path): _info(m) for path, m in _walk(view)}
  module_call.warn_float32(
      info.base.__name__, info.model_policy.name,
      {n: i.policy.compute_dtype for n, i in infos.items() if i is not None},
      lambda: _census(view, name, args, kwargs), stacklevel=5)


# --- the train step -----------------------------------------------------------------------


def checked_model(model: Any, policy: Policy) -> Any:
  """``model`` as ``make_train_step``'s ``init`` takes it: a view unwrapped (refused if
  its policy is not the step's), a model holding ``eqx.nn.State`` refused, and a pytree
  without modules under a half-precision policy warned about."""
  own = view_policy(model)
  if own is not None and own != policy:
    raise ValueError(
        f"init got a model wrapped with policy {own.name!r}, but this train step's policy "
        f"is {policy.name!r}. Pass the unwrapped model (the train step applies its own "
        "policy), or make the step with the same policy.")
  model = unwrap(model)
  stateful = [path_name(path) or "(model)" for path, m in _walk(model)
              if isinstance(m, eqx.nn.StateIndex)]
  if stateful:
    raise ValueError(
        f"{type(model).__name__} keeps eqx.nn.State (at {', '.join(stateful[:4])}: "
        "BatchNorm, SpectralNorm or another stateful layer). make_train_step calls "
        "loss_fn(model, batch), which cannot hand a new State back, so it trains "
        "stateless Equinox models only: use a norm without state (eqx.nn.LayerNorm, "
        "GroupNorm), or write the step with jaxamp.dynamic_loss_scale and "
        "jaxamp.skip_nonfinite yourself, threading the State.")
  if not any(True for _ in _walk(model)) and policy.compute_dtype.itemsize < 4:
    _warn_once.warn_once(
        ("equinox.no_modules", type(model).__name__, policy.name),
        f"jaxamp: {type(model).__name__} holds no eqx.Module, so no per-module policy "
        f"reaches its computation: loss_fn gets its floating arrays in "
        f"{policy.compute_dtype.name} and computes in whatever dtypes its code and the "
        "batch give (a float32 input promotes every matmul it meets to float32). Cast "
        "the inputs in loss_fn, or use make_train_step(..., opt_level='O1'), which "
        "decides precision per operation.", RuntimeWarning, stacklevel=5)
  return model


# --- inspection helpers --------------------------------------------------------------------


def summary_plan(model: Any, example_inputs: Sequence[Any], example_kwargs: dict[str, Any],
                 policy: PolicyLike | None) -> tuple[Any, Any, Any]:
  """``(rows, params, census)`` for :func:`jaxamp.summary` of an Equinox model."""
  rows = module_policies(model, policy)
  census = None
  if example_inputs or example_kwargs:
    census = matmul_census(model, *example_inputs, policy=policy, **example_kwargs)
  return rows, eqx.filter(unwrap(model), eqx.is_inexact_array), census


def holds_modules(args: Any) -> bool:
  """Whether ``args`` holds an ``eqx.Module``."""
  return any(_is_module(x) for x in jax.tree.leaves(args, is_leaf=_is_module))


def arrays_only(fn: Callable[..., Any], args: Sequence[Any], argnums: Sequence[int]
                ) -> tuple[Callable[..., Any], tuple[Any, ...]]:
  """``fn`` as a function of ``args``' arrays alone, the rest closed over (what
  ``eqx.filter_jit`` does): the differentiated arguments keep their floating arrays,
  the others all their arrays. For :func:`jaxamp.precision_report`."""
  n = len(args)
  diff = {i % n for i in argnums} if n else set()
  parts = [eqx.partition(a, eqx.is_inexact_array if i in diff else eqx.is_array)
           for i, a in enumerate(args)]
  statics = [s for _, s in parts]

  def bound(*dynamic, **kwargs):
    return fn(*(eqx.combine(d, s) for d, s in zip(dynamic, statics)), **kwargs)

  return bound, tuple(d for d, _ in parts)
