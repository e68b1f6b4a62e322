"""Cached greedy and beam-search decoding equal their cache-free definitions."""

from flax import nnx
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from lowrank_attn import models
from lowrank_attn.train import decode

V, BOS, EOS, MAX = 12, 1, 2, 5


@pytest.fixture(scope='module', params=['concat', 'collaborative'])
def model_state(request):
  attention = models.AttentionSpec(num_heads=2, kind=request.param)
  cfg = models.TransformerConfig(
      vocab_size=V,
      emb_dim=16,
      mlp_dim=32,
      num_encoder_layers=1,
      num_decoder_layers=2,
      encoder_attention=attention,
      decoder_attention=attention,
      cross_attention=attention,
      max_length=16,
      dropout_rate=0.0,
      tie_embeddings=False,
  )
  model = models.EncoderDecoder(cfg, bos_id=BOS, rngs=nnx.Rngs(0))
  # Make EOS likely enough that some hypotheses finish early.
  # An EOS logit of 0 (neither likely nor rare) makes hypotheses end at different lengths
  # or not at all: the search exercises finishing, pruning and cache reordering.
  model.output.kernel[...] = model.output.kernel[...].at[:, EOS].set(0.0)
  graphdef, params = nnx.split(model, nnx.Param)
  return graphdef, nnx.to_pure_dict(params)


def sources():
  r = np.random.RandomState(0)
  x = r.randint(3, V, (3, 7)).astype(np.int32)
  x[1, 4:] = 0
  return jnp.asarray(x)


def log_probs_fn(graphdef, params, inputs):
  """Next-token log-probabilities after a whole prefix, recomputed without any cache."""

  @jax.jit
  def fn(prefix):
    model = nnx.merge(graphdef, params)
    encoded, _ = model.encode(inputs)
    logits, _ = model.decode(encoded, inputs, prefix)
    return jax.nn.log_softmax(logits[:, -1].at[:, 0].set(-jnp.inf))  # never padding

  return fn


def test_cached_greedy_equals_recomputed_greedy(model_state):
  graphdef, params = model_state
  inputs = sources()
  out = np.asarray(
      decode.translate(
          graphdef, params, inputs, bos_id=BOS, eos_id=EOS, max_length=MAX, beam_size=1
      )
  )
  fn = log_probs_fn(graphdef, params, inputs)
  prefix = np.full((3, 1), BOS, np.int32)
  expected = np.zeros((3, MAX), np.int32)
  done = np.zeros(3, bool)
  for i in range(MAX):
    nxt = np.asarray(jnp.argmax(fn(jnp.asarray(prefix)), -1))
    nxt = np.where(done, 0, nxt)
    expected[:, i] = nxt
    done |= nxt == EOS
    prefix = np.concatenate([prefix, nxt[:, None]], axis=1)
  np.testing.assert_array_equal(out, expected)


def reference_beam_search(fn, batch, k, alpha):
  """The same search in plain numpy, every step recomputed from the prefixes (no cache)."""
  lp = lambda n: ((5.0 + n) / 6.0) ** alpha
  live = [[((), 0.0)] for _ in range(batch)]
  finished = [[] for _ in range(batch)]
  for i in range(MAX):
    prefixes = [[(BOS,) + seq for seq, _ in rows] for rows in live]
    for b in range(batch):
      logp = np.asarray(fn(jnp.asarray(prefixes[b], jnp.int32)))
      candidates = sorted(
          (
              (score + logp[j, t], seq + (t,))
              for j, (seq, score) in enumerate(live[b])
              for t in range(V)
          ),
          key=lambda c: -c[0],
      )[: 2 * k]
      finished[b] += [(seq, s / lp(i + 1)) for s, seq in candidates if seq[-1] == EOS]
      finished[b] = sorted(finished[b], key=lambda c: -c[1])[:k]
      live[b] = [(seq, s) for s, seq in candidates if seq[-1] != EOS][:k]
  out = np.zeros((batch, MAX), np.int32)
  for b in range(batch):
    seq = finished[b][0][0] if finished[b] else live[b][0][0]
    out[b, : len(seq)] = seq
  return out


def test_cached_beam_search_equals_recomputed_beam_search(model_state):
  graphdef, params = model_state
  inputs = sources()
  k, alpha = 3, 2.0  # a strong length penalty: long hypotheses compete with early EOS
  out = np.asarray(
      decode.translate(
          graphdef,
          params,
          inputs,
          bos_id=BOS,
          eos_id=EOS,
          max_length=MAX,
          beam_size=k,
          length_penalty=alpha,
      )
  )
  rows = []
  for b in range(inputs.shape[0]):
    row_inputs = inputs[b : b + 1]
    single = log_probs_fn(graphdef, params, jnp.repeat(row_inputs, k, axis=0))
    fn = lambda prefixes, single=single: single(
        jnp.concatenate([prefixes, jnp.repeat(prefixes[-1:], k - len(prefixes), 0)])
    )[: len(prefixes)]
    rows.append(reference_beam_search(fn, 1, k, alpha)[0])
  # The jitted search stops early once no live hypothesis can win; that never changes the
  # answer, so the results agree with the exhaustive-length reference.
  np.testing.assert_array_equal(out, np.stack(rows))
  greedy = np.asarray(
      decode.translate(
          graphdef, params, inputs, bos_id=BOS, eos_id=EOS, max_length=MAX, beam_size=1
      )
  )
  assert not np.array_equal(out, greedy)  # the search did something greedy would not


def test_strip_stops_at_eos():
  assert decode.strip([5, 6, 0, 7, EOS, 9], EOS) == [5, 6, 7]


# ------------------------------------------- the length penalty, on a scripted step function

# Vocabulary: 0 pad, 1 BOS, 2 EOS, 3 'a'. A scripted model whose next-token distribution
# depends only on the sentence and the position: EOS after j tokens 'a' with probability
# STOP[b, j]. The finished hypotheses are 'a'^j EOS (length j + 1), log p = sum_{t<j}
# log(1 - STOP[b, t]) + log STOP[b, j]; the search returns the one of best
# log p / ((5 + length) / 6) ** alpha (Wu et al. 2016, eq. 14).


def _stop_table(finished, length=6):
  """STOP of one sentence whose hypothesis 'a'^j EOS has log p `finished[j]` (other
  positions stop with probability 1e-4)."""
  stop, survived = np.full(length, 1e-4), 0.0
  for j in range(length):
    if j in finished:
      stop[j] = np.exp(finished[j] - survived)
    survived += np.log1p(-stop[j])
  return stop


# Sentence 0: lengths 1, 3, 6 win in turn as alpha grows (at 0.78 and 0.97); sentence 1:
# lengths 2 then 5 (at 1.03).
STOP = np.stack([_stop_table({0: -1.0, 2: -1.25, 5: -1.7}), _stop_table({1: -0.9, 4: -1.3})])


def _scripted_step(cache, tokens, position):
  """`decode._search`'s step: log-probabilities `[n, 4]` of sentence `cache['row']`."""
  stop = jnp.asarray(STOP, jnp.float32)[cache['row'], position]
  neg = jnp.full_like(stop, -jnp.inf)
  return jnp.stack([neg, neg, jnp.log(stop), jnp.log1p(-stop)], axis=-1), cache


def _best_finished(b, alpha):
  """The search's answer by enumeration (float64): 'a'^j EOS of the best score."""
  scores = []
  for j in range(STOP.shape[1]):
    logp = np.sum(np.log1p(-STOP[b, :j])) + np.log(STOP[b, j])
    scores.append(logp / ((5.0 + j + 1) / 6.0) ** alpha)
  j = int(np.argmax(scores))
  return [3] * j + [EOS] + [0] * (STOP.shape[1] - j - 1)


def test_length_penalty_ranks_finished_hypotheses_of_different_lengths():
  k, length = 2, STOP.shape[1]
  search = jax.jit(
      lambda alpha: decode._beam_search(
          _scripted_step, {'row': jnp.arange(2 * k) // k}, 2, k, BOS, EOS, length, alpha
      )
  )
  chosen = set()
  # Between alpha 0 (short wins) and 2 (long wins) the winner changes at alphas that move
  # with any change to the penalty's form or to what counts as a hypothesis' length.
  for alpha in np.linspace(0.0, 2.0, 41):
    out = np.asarray(search(jnp.float32(alpha)))
    for b in range(2):
      want = _best_finished(b, alpha)
      assert out[b].tolist() == want, (alpha, b)
      chosen.add((b, want.index(EOS)))
  assert len(chosen) >= 5  # the grid saw several winners per sentence


def test_beam_search_keeps_a_live_hypothesis_the_length_penalty_can_still_lift():
  """Stopping rule (Wu et al. 2016): a live hypothesis is dropped only when even at max_length
  its score could not beat the best finished one. Here 'EOS' at once has log p -0.3 (score
  -0.3), the live 'a' has -1.35 after one step but finishes at length 12 with -1.36 almost for
  free: at alpha 2 its score -1.36 / (17/6)^2 = -0.17 wins, which a bound taken at the current
  length (-1.35 / 1) would never let the search reach."""
  length, k = 12, 2
  stop = np.stack([_stop_table({0: -0.3, length - 1: -1.36}, length)] * 2)

  def step(cache, tokens, position):
    p = jnp.asarray(stop, jnp.float32)[cache['row'], position]
    neg = jnp.full_like(p, -jnp.inf)
    return jnp.stack([neg, neg, jnp.log(p), jnp.log1p(-p)], axis=-1), cache

  def search(alpha):
    return np.asarray(
        decode._beam_search(step, {'row': jnp.arange(2 * k) // k}, 2, k, BOS, EOS, length, alpha)
    )

  for alpha, j in ((2.0, length - 1), (1.0, 0)):  # long wins at 2, short at 1 (-0.48 < -0.3)
    scores = [
        (np.sum(np.log1p(-stop[0, :i])) + np.log(stop[0, i])) / ((5.0 + i + 1) / 6.0) ** alpha
        for i in range(length)
    ]
    assert int(np.argmax(scores)) == j
    want = [3] * j + [EOS] + [0] * (length - j - 1)
    assert search(alpha)[0].tolist() == want, alpha


def test_bleu_is_cased_and_13a_tokenised_by_hand():
  """Papineni et al. (2002) on one sentence: 13a splits the final '.', so 'The cat sat on
  the mat.' is 7 tokens; against a reference differing only in the case of the first word,
  1- to 4-gram precisions are 6/7, 5/6, 4/5, 3/4 and the brevity penalty 1."""
  reference = 'the cat sat on the mat.'
  scores = decode.score(['The cat sat on the mat.'], [reference])
  np.testing.assert_allclose(
      scores['bleu'], 100 * (6 / 7 * 5 / 6 * 4 / 5 * 3 / 4) ** 0.25, rtol=1e-9
  )
  np.testing.assert_allclose(decode.score([reference], [reference])['bleu'], 100.0, rtol=1e-12)
