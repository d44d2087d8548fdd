"""Tests for jaxamp.opt_levels: Apex's O0-O3 presets, half dtype, overrides, errors."""

import jax.numpy as jnp
import optax
import pytest

import jaxamp
from jaxamp import OptLevel, Policy, opt_level

F16, BF16, F32 = jnp.float16, jnp.bfloat16, jnp.float32


@pytest.mark.parametrize("name,policy,loss_scale,autocast,keep_norms,master", [
    ("O0", Policy(F32), None, False, True, False),
    ("O1", Policy(F32, F16, F32), "dynamic", True, True, False),
    ("O2", Policy(F16), "dynamic", False, True, True),
    ("O3", Policy(F16), None, False, False, False),
])
def test_presets_follow_apex(name, policy, loss_scale, autocast, keep_norms, master):
  assert opt_level(name) == OptLevel(name, policy, loss_scale, autocast, keep_norms, master)


@pytest.mark.parametrize("name,policy", [
    ("O0", Policy(F32)), ("O1", Policy(F32, BF16, F32)), ("O2", Policy(BF16)), ("O3", Policy(BF16)),
])
def test_bfloat16_needs_no_loss_scaling(name, policy):
  level = opt_level(name, half=BF16)
  assert level.policy == policy and level.loss_scale is None
  assert level._replace(policy=None) == opt_level(name)._replace(policy=None, loss_scale=None)


def test_overrides():
  level = opt_level("O2", keep_norms_float32=False, loss_scale=128.0, master_weights=False)
  assert (level.keep_norms_float32, level.loss_scale, level.master_weights) == (False, 128.0, False)
  assert opt_level("O1", policy="mixed_bfloat16").policy == jaxamp.get_policy("mixed_bfloat16")
  assert opt_level("O3", loss_scale="dynamic").loss_scale == "dynamic"
  assert opt_level(opt_level("O1"), autocast=False) == opt_level("O1")._replace(autocast=False)
  factory = lambda: jaxamp.static_loss_scale(8.0)
  assert opt_level("O1", loss_scale=factory).loss_scale is factory


def test_errors_name_the_valid_values():
  with pytest.raises(ValueError, match="'O4'.*'O0', 'O1', 'O2', 'O3'"):
    opt_level("O4")
  with pytest.raises(ValueError, match="letter O, not the digit zero"):
    opt_level("01")
  with pytest.raises(ValueError, match="half must be float16 or bfloat16"):
    opt_level("O1", half=F32)
  with pytest.raises(ValueError, match="half must be float16 or bfloat16"):
    opt_level("O1", half="half-ish")
  with pytest.raises(ValueError, match=r"\['keep_bn_fp32'\].*keep_norms_float32"):
    opt_level("O2", keep_bn_fp32=True)
  with pytest.raises(ValueError, match="loss_scale must be 'dynamic', None"):
    opt_level("O1", loss_scale=-1.0)
  with pytest.raises(ValueError, match="loss_scale must be 'dynamic'.*float32 maximum"):
    opt_level("O1", loss_scale=1e39)  # was accepted, then failed when the step was built
  with pytest.raises(ValueError, match="loss_scale must be"):
    opt_level("O1", loss_scale="static")
  with pytest.raises(ValueError, match="autocast must be True or False"):
    opt_level("O1", autocast=1)
  with pytest.raises(ValueError, match="Unknown"):
    opt_level("O1", policy="mixed_float8")


@pytest.mark.parametrize("spec,expected", [
    ("dynamic", 2.0**15), (None, 1.0), (64.0, 64.0), (lambda: jaxamp.static_loss_scale(4.0), 4.0),
])
def test_make_loss_scale(spec, expected):
  transform = opt_level("O1", loss_scale=spec).make_loss_scale()
  assert isinstance(transform, optax.GradientTransformation)
  state = transform.init({"w": jnp.ones(2)})
  assert float(jaxamp.get_loss_scale(state)) == expected


def test_o1_preset_drives_autocast():
  level = opt_level("O1", half=BF16)
  assert level.autocast
  f = jaxamp.autocast(lambda x, w: x @ w, level.policy)
  assert jaxamp.precision_report(f, jnp.ones((2, 4)), jnp.ones((4, 4))).half_share == 1.0
