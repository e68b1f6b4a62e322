"""The pure kernels: equivalences between kinds, masks, decoding, transforms, dtypes, errors."""

import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.test_util import check_grads

from lowrank_attn import attention as A
from lowrank_attn.reparam import concat_to_collaborative

KINDS_AND_OPTIONS = [
    dict(kind='concat'),
    dict(kind='fixed_head', head_dim=12),
    dict(kind='collaborative', key_dim=12),
    dict(kind='collaborative', key_dim=12, use_bias=False),
    dict(kind='talking_heads'),
    dict(kind='concat', num_kv_heads=2),
    dict(kind='concat', normalize_qk=True),
    dict(kind='concat', gated=True),
    dict(kind='collaborative', gated=True),
]
IDS = ['-'.join(f'{k}={v}' for k, v in o.items()) for o in KINDS_AND_OPTIONS]


def spec_of(**options):
  return A.AttentionSpec(num_heads=4, in_features=16, **options)


def inputs(shape=(2, 6, 16), seed=1):
  return jax.random.normal(jax.random.key(seed), shape)


def run(params, x, spec, **kwargs):
  return A.multi_head_attention(params, x, spec=spec, **kwargs).out


def tolerance(numpy_reference, params, x, spec, mask=None, *, y=None, head_mask=None):
  """How far two float32 programs for `run(params, x, spec, mask=mask, head_mask=head_mask)`
  may differ, from this computation's rounding measured on this machine
  (`numpy_reference.float32_tolerance`; leading batch axes of x flattened into one)."""
  return numpy_reference.float32_tolerance(
      params,
      x.reshape((-1,) + x.shape[-2:]),
      y,
      kind=spec.kind,
      mask=mask,
      head_mask=head_mask,
      normalize_qk=spec.normalize_qk,
  )[0]


CAUSAL = lambda n: np.tril(np.ones((n, n), bool))


# ------------------------------------------------------------------ equivalences between kinds


def test_fixed_head_lifts_the_rank_of_each_heads_logits(make_params):
  """Bhojanapalli et al.: with head size d < n a head's n x n logits have rank <= d."""
  x = inputs((1, 24, 32))
  for spec, rank in (
      (A.AttentionSpec(4, 32, kind='concat'), 8),
      (A.AttentionSpec(4, 32, kind='fixed_head', head_dim=24), 24),
  ):
    params = make_params(spec)
    q, k, _, _ = A.project(params, spec, x, x, x)
    head_logits = A.logits(params, spec, q, k, None)[0, 0]
    assert np.linalg.matrix_rank(np.asarray(head_logits, np.float64), tol=1e-4) == rank


@pytest.mark.parametrize('use_bias', [True, False])
def test_collaborative_concatenate_full_width_is_concat(make_params, numpy_reference, use_bias):
  concat = spec_of(kind='concat', use_bias=use_bias)
  params = make_params(concat)
  collab_params, collab = concat_to_collaborative(params, concat)
  assert collab.kind == 'collaborative' and collab.key_dim == 16
  # Head i owns key columns 4i..4i+3: block one-hot, written out (the converter itself calls
  # A.concatenate_mixing, so comparing with it could not fail for a bug in it).
  np.testing.assert_array_equal(collab_params['mixing'], np.repeat(np.eye(4), 4, axis=1))
  x, y = inputs(), inputs((2, 9, 16), seed=2)
  numpy_reference.assert_within(
      A.multi_head_attention(collab_params, x, y, spec=collab).out,
      A.multi_head_attention(params, x, y, spec=concat).out,
      tolerance(numpy_reference, params, x, concat, y=y),
  )


def test_collaborative_keeps_the_scale_it_is_given():
  """Below full width the default scale is 1/sqrt(key_dim/h) (fresh training), but an
  explicit scale (a re-parametrized layer) is kept, never recomputed from key_dim."""
  assert spec_of(kind='collaborative', key_dim=8).logit_scale == pytest.approx(1 / math.sqrt(2))
  kept = spec_of(kind='collaborative', key_dim=8, logit_scale=0.5)
  assert dataclasses.replace(kept, key_dim=4).logit_scale == 0.5


@pytest.mark.parametrize('options', KINDS_AND_OPTIONS[:5], ids=IDS[:5])
def test_gated_with_all_gates_open_is_its_base_kind(make_params, options):
  base = spec_of(**options)
  gated = dataclasses.replace(base, gated=True)
  params = make_params(base)
  gated_params = {**params, 'gate_log_alpha': jnp.full((4,), 3.0)}  # > log(11): gate == 1
  x = inputs()
  np.testing.assert_array_equal(
      run(gated_params, x, gated, is_causal=True), run(params, x, base, is_causal=True)
  )


def test_talking_heads_with_identity_mixing_is_concat(make_params, numpy_reference):
  concat, talking = spec_of(kind='concat'), spec_of(kind='talking_heads')
  params = make_params(concat)
  identity = {'pre_softmax_mixing': jnp.eye(4), 'post_softmax_mixing': jnp.eye(4)}
  x = inputs()
  mask = jax.random.bernoulli(jax.random.key(3), 0.7, (2, 1, 6, 6))
  numpy_reference.assert_within(
      run({**params, **identity}, x, talking, mask=mask),
      run(params, x, concat, mask=mask),
      tolerance(numpy_reference, params, x, concat, mask),
  )


def test_talking_heads_mixes_heads(make_params):
  talking = spec_of(kind='talking_heads')
  params = make_params(talking)
  weights = A.multi_head_attention(params, inputs(), spec=talking, return_weights=True).weights
  concat_params = {k: v for k, v in params.items() if 'mixing' not in k}
  plain = A.multi_head_attention(
      concat_params, inputs(), spec=spec_of(), return_weights=True
  ).weights
  assert not np.allclose(weights, plain, atol=1e-3)


# ------------------------------------------------------------------ masks


@pytest.mark.parametrize('options', KINDS_AND_OPTIONS, ids=IDS)
def test_padding_mask_equals_attention_on_the_unpadded_sequence(
    make_params, options, numpy_reference
):
  spec = spec_of(**options)
  params = make_params(spec)
  x = inputs((1, 9, 16))
  valid = jnp.arange(9) < 6
  mask = A.padding_mask(valid[None], valid[None])
  padded = A.multi_head_attention(params, x, spec=spec, mask=mask).out[:, :6]
  short = A.multi_head_attention(params, x[:, :6], spec=spec).out
  numpy_reference.assert_within(padded, short, tolerance(numpy_reference, params, x, spec, mask))


@pytest.mark.parametrize('options', KINDS_AND_OPTIONS, ids=IDS)
def test_fully_masked_query_rows_give_zero_and_finite_gradients(make_params, options):
  spec = spec_of(**options)
  params = make_params(spec)
  x = inputs()
  mask = jnp.ones((2, 1, 6, 6), bool).at[:, :, 2, :].set(False).at[1].set(False)

  def loss(params, x):
    result = A.multi_head_attention(params, x, spec=spec, mask=mask, return_weights=True)
    return jnp.sum(result.out**2), (result.out, result.weights)

  (value, (out, weights)), grads = jax.value_and_grad(loss, has_aux=True, argnums=(0, 1))(params, x)
  assert np.isfinite(value) and all(np.all(np.isfinite(g)) for g in jax.tree.leaves(grads))
  np.testing.assert_array_equal(weights[:, :, 2], 0.0)
  np.testing.assert_array_equal(weights[1], 0.0)
  bias = params.get('out_bias', jnp.zeros(16))
  np.testing.assert_allclose(out[:, 2], jnp.broadcast_to(bias, (2, 16)), atol=1e-6)
  if spec.kind != 'talking_heads':  # post-softmax head mixing does not keep rows normalized
    np.testing.assert_allclose(weights[0, :, 3].sum(-1), 1.0, atol=1e-5)


def test_causal_flag_equals_an_explicit_causal_mask_and_hides_the_future(make_params):
  spec = spec_of(kind='collaborative', key_dim=12)
  params = make_params(spec)
  x = inputs()
  causal = run(params, x, spec, is_causal=True)
  np.testing.assert_array_equal(causal, run(params, x, spec, mask=A.causal_mask(6)))
  changed_future = x.at[:, 4:].set(7.0)
  np.testing.assert_allclose(
      run(params, changed_future, spec, is_causal=True)[:, :4], causal[:, :4], atol=1e-6
  )


def test_arbitrary_per_head_boolean_mask(make_params):
  spec = spec_of()
  params = make_params(spec)
  mask = jax.random.bernoulli(jax.random.key(5), 0.5, (2, 4, 6, 6))
  weights = A.multi_head_attention(
      params, inputs(), spec=spec, mask=mask, return_weights=True
  ).weights
  assert np.all(np.asarray(weights)[~np.asarray(mask)] == 0.0)
  rows = np.asarray(mask).any(-1)
  np.testing.assert_allclose(np.asarray(weights.sum(-1))[rows], 1.0, atol=1e-5)


def test_segment_mask_keeps_packed_sequences_apart(make_params, numpy_reference):
  spec = spec_of()
  params = make_params(spec)
  x = inputs((1, 8, 16))
  segments = jnp.array([[1, 1, 1, 2, 2, 2, 2, 0]])
  mask = A.segment_mask(segments, segments)
  packed = run(params, x, spec, mask=mask, is_causal=True)
  first = run(params, x[:, :3], spec, is_causal=True)
  second = run(params, x[:, 3:7], spec, is_causal=True)
  limit = tolerance(numpy_reference, params, x, spec, np.asarray(mask) & CAUSAL(8))
  numpy_reference.assert_within(packed[:, :3], first, limit)
  numpy_reference.assert_within(packed[:, 3:7], second, limit)


# ------------------------------------------------------------------ decoding cache


@pytest.mark.parametrize('options', KINDS_AND_OPTIONS, ids=IDS)
def test_decoding_step_by_step_equals_the_full_causal_pass(make_params, options, numpy_reference):
  spec = spec_of(**options)
  params = make_params(spec)
  x = inputs((2, 7, 16))
  full = run(params, x, spec, is_causal=True)
  cache = A.init_cache(spec, (2,), max_length=7)
  steps = []
  # A prefill chunk of 3, then one position at a time.
  for start, stop in [(0, 3)] + [(t, t + 1) for t in range(3, 7)]:
    result = A.multi_head_attention(params, x[:, start:stop], spec=spec, cache=cache)
    steps.append(result.out)
    cache = result.cache
  assert int(cache['index']) == 7
  limit = tolerance(numpy_reference, params, x, spec, CAUSAL(7))
  numpy_reference.assert_within(jnp.concatenate(steps, axis=1), full, limit)


def test_collaborative_cache_holds_one_shared_key_per_position():
  cache = A.init_cache(spec_of(kind='collaborative', key_dim=6), (3,), max_length=10)
  assert cache['key'].shape == (3, 10, 6)
  assert cache['content_bias'].shape == (3, 10, 4)
  assert A.init_cache(spec_of(), (3,), 10)['key'].shape == (3, 10, 4, 4)


def test_decoding_under_jit_with_a_traced_index(make_params, numpy_reference):
  spec = spec_of(kind='collaborative', key_dim=8)
  params = make_params(spec)
  x = inputs((2, 5, 16))
  step = jax.jit(lambda cache, xt: A.multi_head_attention(params, xt, spec=spec, cache=cache))
  cache, outs = A.init_cache(spec, (2,), 5), []
  for t in range(5):
    result = step(cache, x[:, t : t + 1])
    outs.append(result.out)
    cache = result.cache
  numpy_reference.assert_within(
      jnp.concatenate(outs, 1),
      run(params, x, spec, is_causal=True),
      tolerance(numpy_reference, params, x, spec, CAUSAL(5)),
  )


# ------------------------------------------------------------------ head masks and importance


def test_head_mask_zero_equals_removing_the_head_from_the_output_projection(
    make_params, numpy_reference
):
  spec = spec_of()
  params = make_params(spec)
  x = inputs()
  head_mask = jnp.array([1.0, 0.0, 1.0, 1.0])
  pruned = {**params, 'out_kernel': params['out_kernel'].at[1].set(0.0)}
  numpy_reference.assert_within(
      run(params, x, spec, head_mask=head_mask),
      run(pruned, x, spec),
      tolerance(numpy_reference, params, x, spec, head_mask=head_mask),
  )


def test_head_mask_gradient_is_the_michel_head_importance(make_params):
  """The output is linear in the head mask, so d L / d m_i = L(e_i) - L(0) for linear L."""
  spec = spec_of(kind='collaborative', key_dim=8)
  params = make_params(spec)
  x = inputs()
  cotangent = jax.random.normal(jax.random.key(7), (2, 6, 16))
  loss = lambda m: jnp.sum(run(params, x, spec, head_mask=m) * cotangent)
  importance = jax.grad(loss)(jnp.ones(4))
  expected = [loss(jnp.eye(4)[i]) - loss(jnp.zeros(4)) for i in range(4)]
  np.testing.assert_allclose(importance, expected, rtol=1e-4, atol=1e-4)
  per_example = jax.grad(loss)(jnp.ones((2, 4)))  # [batch, heads] masks work too
  np.testing.assert_allclose(per_example.sum(0), importance, rtol=1e-4, atol=1e-4)


# ------------------------------------------------------------------ dropout and gates in training


def test_dropout_zeroes_weights_and_is_unbiased(make_params):
  spec = spec_of()
  params = make_params(spec)
  x = inputs((1, 6, 16))
  call = lambda rng: A.multi_head_attention(
      params, x, spec=spec, rng=rng, dropout_rate=0.5, deterministic=False, broadcast_dropout=False
  )
  outs = jax.vmap(lambda r: call(r).out)(jax.random.split(jax.random.key(0), 4000))
  # The mean of 4000 draws is within 5 standard errors of the dropout-free output.
  z = (outs.mean(0) - run(params, x, spec)) / (outs.std(0) / np.sqrt(len(outs)))
  assert np.abs(z).max() < 5
  assert not np.allclose(outs[0], outs[1])
  # deterministic=True switches dropout off even when a rate and a key are given.
  evaluation = A.multi_head_attention(
      params, x, spec=spec, rng=jax.random.key(1), dropout_rate=0.5, deterministic=True
  ).out
  np.testing.assert_array_equal(evaluation, run(params, x, spec))


def test_training_mode_gates_are_sampled_and_eval_gates_are_fixed(make_params, numpy_reference):
  spec = spec_of(gated=True)
  params = {**make_params(spec), 'gate_log_alpha': jnp.zeros(4)}
  x = inputs()
  train = lambda seed: A.multi_head_attention(
      params, x, spec=spec, rng=jax.random.key(seed), deterministic=False
  ).out
  assert not np.allclose(train(0), train(1))
  # Evaluation: every head scaled by its eq.-13 gate, sigmoid(0) * 1.2 - 0.1 = 0.5.
  gate = numpy_reference.hard_concrete_eval(0.0)
  assert gate == pytest.approx(0.5)
  ungated = dataclasses.replace(spec, gated=False)
  open_params = {k: v for k, v in params.items() if k != 'gate_log_alpha'}
  numpy_reference.assert_within(
      run(params, x, spec),
      run(open_params, x, ungated, head_mask=jnp.full(4, gate)),
      tolerance(numpy_reference, params, x, spec),
  )


# ------------------------------------------------------------------ transforms and dtypes


@pytest.mark.parametrize('options', KINDS_AND_OPTIONS, ids=IDS)
def test_jit_vmap_and_grad(make_params, numpy_reference, options):
  spec = spec_of(**options)
  params = make_params(spec)
  x = inputs((3, 2, 5, 16))  # two batch dims
  eager = run(params, x, spec, is_causal=True)
  jitted = jax.jit(lambda p, x: run(p, x, spec, is_causal=True))(params, x)
  rounding = tolerance(numpy_reference, params, x, spec, CAUSAL(5))
  numpy_reference.assert_within(jitted, eager, rounding)
  vmapped = jax.vmap(lambda x: run(params, x, spec, is_causal=True))(x)
  numpy_reference.assert_within(vmapped, eager, rounding)
  check_grads(
      lambda p: run(p, x[0, :1], spec, is_causal=True),
      (params,),
      order=1,
      modes=['rev'],
      atol=5e-2,
      rtol=5e-2,
  )


@pytest.mark.parametrize('options', KINDS_AND_OPTIONS, ids=IDS)
def test_bfloat16_inputs_with_float32_softmax(make_params, options):
  spec = spec_of(**options)
  params = make_params(spec)
  x = inputs()
  reference = A.multi_head_attention(params, x, spec=spec, is_causal=True).out
  params16 = {k: v.astype(jnp.bfloat16) for k, v in params.items()}
  out, weights = A.multi_head_attention(
      params16, x.astype(jnp.bfloat16), spec=spec, is_causal=True, return_weights=True
  )[:2]
  assert out.dtype == jnp.bfloat16 and weights.dtype == jnp.float32
  if spec.kind != 'talking_heads':
    np.testing.assert_allclose(weights.sum(-1), 1.0, atol=1e-5)
  np.testing.assert_allclose(out.astype(jnp.float32), reference, atol=0.1, rtol=0.05)


def test_float32_parameters_with_bfloat16_compute_dtype(make_params):
  spec = spec_of()
  params = make_params(spec)
  out = A.multi_head_attention(params, inputs(), spec=spec, dtype=jnp.bfloat16).out
  assert out.dtype == jnp.bfloat16


# ------------------------------------------------------------------ size and cost


def count_matmul_flops(fn, *args):
  """2 x multiply-adds of every dot_general XLA is asked to run (from the jaxpr)."""
  total = 0

  def visit(jaxpr):
    nonlocal total
    for eqn in jaxpr.eqns:
      if eqn.primitive.name == 'dot_general':
        (contract, _), _ = eqn.params['dimension_numbers']
        lhs = eqn.invars[0].aval.shape
        total += 2 * math.prod(eqn.outvars[0].aval.shape) * math.prod(lhs[i] for i in contract)
      for param in eqn.params.values():
        if hasattr(param, 'jaxpr'):
          visit(param.jaxpr)

  visit(jax.make_jaxpr(fn)(*args).jaxpr)
  return total


@pytest.mark.parametrize(
    'options',
    KINDS_AND_OPTIONS + [dict(kind='fixed_head', head_dim=40, in_kv_features=24, out_features=8)],
    ids=IDS + ['mixed'],
)
def test_analytic_flops_equal_the_matmuls_xla_runs(make_params, options):
  spec = spec_of(**options)
  params = make_params(spec)
  x = inputs((3, 5, 16))
  y = inputs((3, 11, spec.in_kv_features), seed=4)
  counted = count_matmul_flops(lambda p: A.multi_head_attention(p, x, y, spec=spec).out, params)
  assert spec.flops(batch=3, q_length=5, kv_length=11) == counted


def test_parameter_count_and_flops_by_kind():
  D, h, n = 512, 8, 128
  concat = A.AttentionSpec(num_heads=h, in_features=D)
  assert concat.num_params() == 4 * D * D + 4 * D
  collab = A.AttentionSpec(num_heads=h, in_features=D, kind='collaborative', key_dim=128)
  # W~_Q, W~_K: D x 128 each; mixing h x 128; content bias D x h; values and output as concat.
  assert collab.num_params() == 2 * D * 128 + h * 128 + D * h + 2 * D * D + 2 * D
  assert collab.flops(1, n) < concat.flops(1, n)


# ------------------------------------------------------------------ errors


@pytest.mark.parametrize(
    'options, message',
    [
        (dict(kind='concat', qkv_features=30), 'qkv_features=30 must be divisible by num_heads=4'),
        (dict(kind='fixed_head'), "kind='fixed_head' needs head_dim"),
        (dict(kind='collaborative', key_dim=0), 'key_dim=0 must be an integer >= 1'),
        (dict(kind='concat', key_dim=8), "key_dim=8 is only used by kind='collaborative'"),
        (dict(kind='multi-query'), "kind='multi-query' is not one of"),
        (dict(kind='concat', num_kv_heads=3), 'num_heads=4 must be divisible by num_kv_heads=3'),
        (dict(kind='concat', head_dim=8, qkv_features=16), 'qkv_features=16 conflicts'),
        (dict(kind='collaborative', normalize_qk=True), 'normalize_qk=True is only defined'),
        (dict(kind='concat', logit_scale=-1.0), 'logit_scale=-1.0 must be a number > 0'),
        (dict(kind='concat', head_dim=0), 'head_dim=0 must be an integer >= 1'),
    ],
)
def test_invalid_settings_name_the_argument(options, message):
  with pytest.raises(ValueError, match=message.replace('(', r'\(').replace('[', r'\[')):
    spec_of(**options)


def test_invalid_gate_settings():
  with pytest.raises(ValueError, match='temperature'):
    A.HardConcrete(temperature=0.0)
  with pytest.raises(ValueError, match='stretch'):
    A.HardConcrete(stretch=(0.0, 1.0))


def test_invalid_call_arguments_name_what_was_wrong(make_params):
  spec = spec_of()
  params = make_params(spec)
  x = inputs()
  with pytest.raises(ValueError, match=r'mask has shape \(2, 5, 6\)'):
    run(params, x, spec, mask=jnp.ones((2, 5, 6), bool))
  with pytest.raises(ValueError, match=r'head_mask has shape \(3,\)'):
    run(params, x, spec, head_mask=jnp.ones(3))
  with pytest.raises(ValueError, match=r'inputs_q has shape \(2, 6, 15\)'):
    run(params, x[..., :15], spec)
  with pytest.raises(ValueError, match=r"params\['out_kernel'\] has shape"):
    run({**params, 'out_kernel': jnp.ones((4, 4, 15))}, x, spec)
  with pytest.raises(ValueError, match=r"missing \['out_kernel'\]"):
    run({k: v for k, v in params.items() if k != 'out_kernel'}, x, spec)
  with pytest.raises(ValueError, match='rng is required'):
    run(params, x, spec, dropout_rate=0.1, deterministic=False)
  with pytest.raises(ValueError, match='dropout_rate=1.5'):
    run(params, x, spec, dropout_rate=1.5)
  with pytest.raises(ValueError, match='exceeds the cache length 4'):
    run(params, x, spec, cache=A.init_cache(spec, (2,), 4))
