"""The README's hand-written recipes run as written and do what the README says."""

import os
import re

import jax
import jax.numpy as jnp
import optax

import jaxamp

README = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "README.md")


def _section_blocks(heading):
  text = open(README, encoding="utf-8").read()
  section = text.split(heading, 1)[1].split("\n### ", 1)[0].split("\n## ", 1)[0]
  return re.findall(r"```python\n(.*?)```", section, flags=re.S)


def test_hand_written_recipes_skip_overflow_steps_exactly():
  optax_step, nnx_step = _section_blocks("### Hand-written steps")
  ns = {}
  exec(optax_step, ns)  # pylint: disable=exec-used
  params, opt_state = ns["params"], ns["opt_state"]
  x = jnp.ones((5, 3), jnp.float16)
  params, opt_state = ns["step"](params, opt_state, x)
  before = (params, opt_state)
  scale = float(jaxamp.get_loss_scale(opt_state))
  params, opt_state = ns["step"](params, opt_state, x * jnp.inf)  # overflows
  assert float(jaxamp.get_loss_scale(opt_state)) == scale / 2
  is_ls = lambda t: isinstance(t, jaxamp.LossScaleState)
  rest = lambda s: [t for t in jax.tree.leaves(s, is_leaf=is_ls) if not is_ls(t)]
  for a, b in zip(rest(before), rest((params, opt_state))):
    assert (a == b).all()  # MultiSteps' accumulator and Adam untouched

  ns = {}
  exec(nnx_step, ns)  # pylint: disable=exec-used
  model, optimizer = ns["model"], ns["optimizer"]
  x, y = jnp.ones((8, 4)), jnp.zeros((8, 2))
  ns["train_step"](model, optimizer, x, y)
  kernel = model.kernel[...]
  ns["train_step"](model, optimizer, x * jnp.inf, y)
  assert (model.kernel[...] == kernel).all()
  assert int(optax.tree_utils.tree_get(optimizer.opt_state, "count")) == 1
  assert float(jaxamp.get_loss_scale(optimizer.opt_state)) == 2.0**14


def test_fp8_example_runs_as_written(capsys):
  import warnings

  (block,) = _section_blocks("### FP8")
  with warnings.catch_warnings():
    warnings.simplefilter("ignore", RuntimeWarning)  # FP8 on CPU runs upcast
    exec(block, {})  # pylint: disable=exec-used
  lines = capsys.readouterr().out.splitlines()
  assert lines[0] == "['layers/0']" and lines[-1] == "True"
