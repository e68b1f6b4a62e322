"""Translation decoding with the decoder's cache: greedy and beam search, and BLEU.

The encoder runs once; the decoder then runs one token per step with `decode=True`, each
self-attention layer appending its keys/values to its cache. The cache is carried through a
`lax.while_loop` as an `nnx.State` (split from the model, merged back each step), so the whole
search is one jitted function.

Beam search keeps, per sentence, `beam_size` live hypotheses and the `beam_size` best finished
ones, scored `log p / ((5 + length) / 6) ** alpha` (Wu et al. 2016, eq. 14); it stops when no
live hypothesis can beat the best finished one.
"""

import functools

from flax import nnx
import jax
from jax.experimental import multihost_utils
import jax.numpy as jnp
import numpy as np
import sacrebleu

_NEG = -1.0e9


def _length_penalty(length, alpha: float):
  return ((5.0 + length) / 6.0) ** alpha


def _gather_beams(tree, index, batch_size: int, beam_size: int):
  """Reorders every `[batch * beam, ...]` leaf by `index` `[batch, beam]` (scalars kept)."""
  def gather(x):
    if x.ndim == 0 or x.shape[0] != batch_size * beam_size:
      return x
    x = x.reshape(batch_size, beam_size, *x.shape[1:])
    idx = index.reshape(index.shape + (1,) * (x.ndim - 2))
    return jnp.take_along_axis(x, idx, axis=1).reshape(batch_size * beam_size, *x.shape[2:])
  return jax.tree.map(gather, tree)


@functools.partial(jax.jit, static_argnames=('graphdef', 'bos_id', 'eos_id', 'max_length',
                                             'beam_size', 'length_penalty'))
def translate(graphdef, params, inputs: jax.Array, *, bos_id: int, eos_id: int,
              max_length: int, beam_size: int = 1, length_penalty: float = 0.6) -> jax.Array:
  """Translations `[batch, max_length]` of source tokens `[batch, source_length]`.

  Tokens after the first EOS are 0. `beam_size=1` is greedy decoding.
  """
  model = nnx.merge(graphdef, params)
  encoded, _ = model.encode(inputs)
  batch_size, k = inputs.shape[0], beam_size
  n = batch_size * k
  encoded = jnp.repeat(encoded, k, axis=0)
  sources = jnp.repeat(inputs, k, axis=0)
  model.init_cache(n, max_length)
  cache_graphdef, model_params, cache = nnx.split(model, nnx.Param, nnx.Cache)

  def step(cache, tokens, position):
    """Next-token log-probabilities `[n, vocab]` after feeding `tokens` `[n]` at `position`."""
    m = nnx.merge(cache_graphdef, model_params, cache)
    logits, _ = m.decode(encoded, sources, tokens[:, None],
                         positions=jnp.full((n, 1), position, jnp.int32), decode=True)
    # Padding (id 0) is never a valid output token.
    logits = logits[:, 0].astype(jnp.float32).at[:, 0].set(-jnp.inf)
    return jax.nn.log_softmax(logits), nnx.state(m, nnx.Cache)

  if k == 1:
    return _greedy(step, cache, batch_size, bos_id, eos_id, max_length)
  return _beam_search(step, cache, batch_size, k, bos_id, eos_id, max_length, length_penalty)


def _greedy(step, cache, batch_size, bos_id, eos_id, max_length):
  def body(carry):
    i, tokens, cache, out, done = carry
    log_probs, cache = step(cache, tokens, i)
    nxt = jnp.where(done, 0, jnp.argmax(log_probs, axis=-1).astype(jnp.int32))
    out = out.at[:, i].set(nxt)
    return i + 1, nxt, cache, out, done | (nxt == eos_id)

  def cond(carry):
    i, _, _, _, done = carry
    return (i < max_length) & ~jnp.all(done)

  init = (jnp.zeros((), jnp.int32), jnp.full((batch_size,), bos_id, jnp.int32), cache,
          jnp.zeros((batch_size, max_length), jnp.int32), jnp.zeros((batch_size,), bool))
  return jax.lax.while_loop(cond, body, init)[3]


def _beam_search(step, cache, b, k, bos_id, eos_id, max_length, alpha):
  def body(carry):
    i, tokens, cache, live_seqs, live_logp, fin_seqs, fin_scores = carry
    log_probs, cache = step(cache, tokens, i)
    vocab = log_probs.shape[-1]
    candidates = (live_logp[..., None] + log_probs.reshape(b, k, vocab)).reshape(b, k * vocab)
    top_logp, top_index = jax.lax.top_k(candidates, 2 * k)  # 2k: k may end with EOS
    beam, token = top_index // vocab, (top_index % vocab).astype(jnp.int32)
    seqs = jnp.take_along_axis(live_seqs, beam[..., None], axis=1).at[:, :, i].set(token)
    ended = token == eos_id

    # Finished: merge this step's EOS candidates into the k best so far.
    scores = jnp.where(ended, top_logp / _length_penalty(i + 1.0, alpha), _NEG)
    fin_scores, keep = jax.lax.top_k(jnp.concatenate([fin_scores, scores], axis=1), k)
    fin_seqs = jnp.take_along_axis(jnp.concatenate([fin_seqs, seqs], axis=1), keep[..., None],
                                   axis=1)
    # Live: the k best candidates that did not end; their caches follow their parent beams.
    live_logp, keep = jax.lax.top_k(jnp.where(ended, _NEG, top_logp), k)
    live_seqs = jnp.take_along_axis(seqs, keep[..., None], axis=1)
    cache = _gather_beams(cache, jnp.take_along_axis(beam, keep, axis=1), b, k)
    tokens = jnp.take_along_axis(token, keep, axis=1).reshape(b * k)
    return i + 1, tokens, cache, live_seqs, live_logp, fin_seqs, fin_scores

  def cond(carry):
    i, _, _, _, live_logp, _, fin_scores = carry
    # Log-probs only fall as tokens are added; the length penalty is largest at max_length.
    best_live = live_logp[:, 0] / _length_penalty(float(max_length), alpha)
    return (i < max_length) & ~jnp.all(fin_scores[:, 0] >= best_live)

  live_logp = jnp.tile(jnp.array([0.0] + [_NEG] * (k - 1), jnp.float32), (b, 1))
  init = (jnp.zeros((), jnp.int32), jnp.full((b * k,), bos_id, jnp.int32), cache,
          jnp.zeros((b, k, max_length), jnp.int32), live_logp,
          jnp.zeros((b, k, max_length), jnp.int32), jnp.full((b, k), _NEG, jnp.float32))
  _, _, _, live_seqs, _, fin_seqs, fin_scores = jax.lax.while_loop(cond, body, init)
  any_finished = fin_scores[:, 0] > _NEG / 2
  return jnp.where(any_finished[:, None], fin_seqs[:, 0], live_seqs[:, 0])


def strip(tokens, eos_id: int) -> list[int]:
  """Token ids up to (without) the first EOS, without padding."""
  out = []
  for t in tokens:
    t = int(t)
    if t == eos_id:
      break
    if t != 0:
      out.append(t)
  return out


def bleu(s, params, pipeline, tokenizer, decode_config) -> dict[str, float]:
  """Corpus BLEU (sacrebleu, default 13a tokenisation) of translations of an eval split.

  References are the detokenised target ids, so the score measures the model, not the
  tokenizer's round trip. `decode_config`: beam_size, length_penalty, max_length, num_examples.
  """
  hypotheses, references = [], []
  limit = decode_config.num_examples
  for batch in pipeline:
    global_batch = s.global_batch(batch)
    with s.activate():
      out = translate(s.graphdef, params, global_batch['inputs'], bos_id=tokenizer.bos_id,
                      eos_id=tokenizer.eos_id, max_length=decode_config.max_length,
                      beam_size=decode_config.beam_size,
                      length_penalty=decode_config.length_penalty)
    out, targets, weights = (np.asarray(multihost_utils.process_allgather(x, tiled=True))
                             for x in (out, global_batch['targets'], global_batch['weights']))
    for row, target, weight in zip(out, targets, weights):
      if weight.sum() == 0:  # padding rows of the last batch
        continue
      hypotheses.append(tokenizer.decode(strip(row, tokenizer.eos_id)))
      references.append(tokenizer.decode(strip(target, tokenizer.eos_id)))
    if 0 < limit <= len(hypotheses):
      break
  if limit > 0:
    hypotheses, references = hypotheses[:limit], references[:limit]
  if not hypotheses:
    return {}
  name = 'bleu' if decode_config.beam_size > 1 else 'bleu_greedy'
  return {name: sacrebleu.corpus_bleu(hypotheses, [references]).score,
          'decoded_examples': float(len(hypotheses))}
