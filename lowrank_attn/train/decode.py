"""Translation decoding with the decoder's cache: greedy and beam search, and BLEU.

The encoder runs once; the decoder then runs one token per step with `decode=True`, each
self-attention layer appending its keys/values to its cache. The cache is carried through a
`lax.while_loop` as an `nnx.State` (split from the model, merged back each step), so the whole
search is one jitted function.

`Translator` translates raw text with it, batched and sorted by length (used by the end of
training's evaluation and by `python -m lowrank_attn.translate`, so both give the same
translations); `score` is sacreBLEU's BLEU and chrF of them.

Beam search keeps, per sentence, `beam_size` live hypotheses and the `beam_size` best finished
ones, scored `log p / ((5 + length) / 6) ** alpha` (Wu et al. 2016, eq. 14); it stops when no
live hypothesis can beat the best finished one.
"""

from collections.abc import Callable, Sequence
import dataclasses
import functools
import math
import time

from flax import nnx
import jax
from jax.experimental import multihost_utils
import jax.numpy as jnp
import numpy as np
import sacrebleu

from lowrank_attn import sharding

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


def _search(
    graphdef,
    params,
    inputs: jax.Array,
    *,
    bos_id: int,
    eos_id: int,
    max_length: int,
    beam_size: int = 1,
    length_penalty: float = 0.6,
) -> jax.Array:
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
    logits, _ = m.decode(
        encoded,
        sources,
        tokens[:, None],
        positions=jnp.full((n, 1), position, jnp.int32),
        decode=True,
    )
    # Padding (id 0) is never a valid output token.
    logits = logits[:, 0].astype(jnp.float32).at[:, 0].set(-jnp.inf)
    return jax.nn.log_softmax(logits), nnx.state(m, nnx.Cache)

  if k == 1:
    return _greedy(step, cache, batch_size, bos_id, eos_id, max_length)
  return _beam_search(step, cache, batch_size, k, bos_id, eos_id, max_length, length_penalty)


translate = jax.jit(
    _search,
    static_argnames=('graphdef', 'bos_id', 'eos_id', 'max_length', 'beam_size', 'length_penalty'),
)
translate.__doc__ = _search.__doc__


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

  init = (
      jnp.zeros((), jnp.int32),
      jnp.full((batch_size,), bos_id, jnp.int32),
      cache,
      jnp.zeros((batch_size, max_length), jnp.int32),
      jnp.zeros((batch_size,), bool),
  )
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
    fin_seqs = jnp.take_along_axis(
        jnp.concatenate([fin_seqs, seqs], axis=1), keep[..., None], axis=1
    )
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
  init = (
      jnp.zeros((), jnp.int32),
      jnp.full((b * k,), bos_id, jnp.int32),
      cache,
      jnp.zeros((b, k, max_length), jnp.int32),
      live_logp,
      jnp.zeros((b, k, max_length), jnp.int32),
      jnp.full((b, k), _NEG, jnp.float32),
  )
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
      out = translate(
          s.graphdef,
          params,
          global_batch['inputs'],
          bos_id=tokenizer.bos_id,
          eos_id=tokenizer.eos_id,
          max_length=decode_config.max_length,
          beam_size=decode_config.beam_size,
          length_penalty=decode_config.length_penalty,
      )
    out, targets, weights = (
        np.asarray(multihost_utils.process_allgather(x, tiled=True))
        for x in (out, global_batch['targets'], global_batch['weights'])
    )
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
  return {
      name: sacrebleu.corpus_bleu(hypotheses, [references]).score,
      'decoded_examples': float(len(hypotheses)),
  }


# ------------------------------------------------------------------------ raw text in, text out


def default_length_bucket(source_max_length: int) -> int:
  """Source lengths are padded up to a multiple of this (capped at `source_max_length`): about
  a third of the longest source, rounded up to 8, so that at most 3-4 shapes compile.

  Each distinct [batch, length] shape compiles the search once (2-3 CPU-seconds for the
  Multi30k model, about one batch of 64 sentences at beam 4), while padding costs less:
  on Multi30k's test set (sources of 6-41 tokens, data.max_length 64) buckets of 24 took 53
  CPU-s in all (2 shapes), of 16 56 s (3 shapes), one shape of 48 tokens 68 s.
  """
  return -(-source_max_length // 24) * 8


@dataclasses.dataclass
class Timing:
  """Where a `Translator`'s time went (seconds, summed over calls)."""

  total_secs: float = 0.0  # the whole of `Translator.translate`
  search_secs: float = 0.0  # running the compiled search, until its output was ready
  compile_secs: float = 0.0  # compiling the search, once per [batch, source length] shape
  # The same in CPU time of this process (all threads): on a machine shared with other jobs,
  # the wall-clock shares also measure the scheduler; these do not.
  total_cpu_secs: float = 0.0
  search_cpu_secs: float = 0.0
  compile_cpu_secs: float = 0.0
  compiles: int = 0
  batches: int = 0
  sentences: int = 0

  @property
  def outside_share(self) -> float:
    """Share of the wall time not spent in the jitted search (compilation included)."""
    return 1.0 - self.search_secs / self.total_secs if self.total_secs > 0 else 0.0

  @property
  def outside_cpu_share(self) -> float:
    """The same share in CPU time."""
    return 1.0 - self.search_cpu_secs / self.total_cpu_secs if self.total_cpu_secs > 0 else 0.0

  def describe(self) -> str:
    rate = self.sentences / self.total_secs if self.total_secs > 0 else 0.0
    host = self.total_secs - self.search_secs - self.compile_secs
    host_cpu = self.total_cpu_secs - self.search_cpu_secs - self.compile_cpu_secs
    return (
        f'{self.sentences} sentences in {self.total_secs:.1f} s: {rate:.1f} sentences/s; '
        f'jitted search {self.search_secs:.1f} s ({100 * (1 - self.outside_share):.1f}%), '
        f'outside it {100 * self.outside_share:.1f}%: compilation {self.compile_secs:.1f} s '
        f'({self.compiles} shapes), host {host:.1f} s (tokenize, batch, detokenize), '
        f'{self.batches} batches. CPU time {self.total_cpu_secs:.1f} s: search '
        f'{self.search_cpu_secs:.1f} s, outside it {100 * self.outside_cpu_share:.1f}% '
        f'(compilation {self.compile_cpu_secs:.1f} s, host {host_cpu:.1f} s)'
    )


@dataclasses.dataclass
class Translations:
  texts: list[str]  # one per input, in input order; '' for an empty input
  truncated: list[int]  # indices of the inputs cut to the longest source the model takes


def round_batch_size(s, batch_size: int) -> int:
  """`batch_size` rounded up to a multiple of the devices (and processes) the batch is split
  over, so that every device gets whole rows."""
  axes = sharding.batch_spec(s.rules, 1)[0]
  axes = () if axes is None else (axes,) if isinstance(axes, str) else tuple(axes)
  shards = math.lcm(math.prod(s.mesh.shape[a] for a in axes), jax.process_count())
  return -(-max(batch_size, 1) // shards) * shards


def default_batch_size(s) -> int:
  """Sentences per search call: the evaluation batch of the run (rows per device x the
  devices of its mesh)."""
  return s.config.per_device_batch_size * s.mesh.size


class Translator:
  """Raw sentences -> translated sentences with one model, on the setup's mesh.

  Sentences are encoded as the evaluation pipeline encodes sources (ids, then EOS, cut to
  `source_max_length` tokens), sorted by length (so a batch's search ends when its sentences
  do, and little is padding), batched by `batch_size` (rounded up to fill every device) and
  padded to a multiple of `default_length_bucket(source_max_length)` tokens, and put back in
  input order. Empty sentences are not searched: they translate to ''. The order in which the
  sentences are given does not change any translation (batches are formed from the sorted
  set). Every process must pass the same sentences; each gets all translations.
  """

  def __init__(
      self,
      s,
      params,
      tokenizer,
      *,
      beam_size: int,
      length_penalty: float,
      max_length: int,
      batch_size: int,
      source_max_length: int,
      length_bucket: int | None = None,
  ):
    self.s, self.params, self.tokenizer = s, params, tokenizer
    self.beam_size, self.length_penalty, self.max_length = beam_size, length_penalty, max_length
    self.batch_size = round_batch_size(s, batch_size)
    self.source_max_length = source_max_length
    self.length_bucket = length_bucket or default_length_bucket(source_max_length)
    self.timing = Timing()
    self._compiled = {}  # (batch, source length) -> compiled search
    self._sharding = sharding.batch_shardings({'inputs': (1, 1)}, s.mesh, s.rules)['inputs']
    self._search = jax.jit(
        functools.partial(
            _search,
            s.graphdef,
            bos_id=tokenizer.bos_id,
            eos_id=tokenizer.eos_id,
            max_length=max_length,
            beam_size=beam_size,
            length_penalty=length_penalty,
        )
    )

  def encode(self, text: str) -> tuple[list[int], bool]:
    """(source ids with EOS, whether they were cut); [] for an empty text."""
    if not text:
      return [], False
    ids = self.tokenizer.encode(text)
    cut = len(ids) > self.source_max_length - 1
    return [*ids[: self.source_max_length - 1], self.tokenizer.eos_id], cut

  def _compiled_search(self, shape: tuple[int, int]):
    if shape not in self._compiled:
      start, cpu = time.perf_counter(), time.process_time()
      inputs = jax.ShapeDtypeStruct(shape, jnp.int32, sharding=self._sharding)
      with self.s.activate():
        self._compiled[shape] = self._search.lower(self.params, inputs).compile()
      self.timing.compile_secs += time.perf_counter() - start
      self.timing.compile_cpu_secs += time.process_time() - cpu
      self.timing.compiles += 1
    return self._compiled[shape]

  def translate(
      self, texts: Sequence[str], progress: Callable[[int, int], None] | None = None
  ) -> Translations:
    """Translations of `texts`; `progress(done, total)` after each batch."""
    start, start_cpu = time.perf_counter(), time.process_time()
    encoded = [self.encode(t) for t in texts]
    truncated = [i for i, (_, cut) in enumerate(encoded) if cut]
    # Sorted by (length, ids): the batches depend on the set of sentences, not their order.
    order = sorted(
        (i for i, (ids, _) in enumerate(encoded) if ids),
        key=lambda i: (len(encoded[i][0]), encoded[i][0]),
    )
    out = [''] * len(texts)
    done = len(texts) - len(order)
    # Fewer sentences than a batch: one smaller batch (a short file need not pay for a full one).
    batch_size = min(self.batch_size, round_batch_size(self.s, len(order)))
    for first in range(0, len(order), batch_size):
      rows = order[first : first + batch_size]
      longest = max(len(encoded[i][0]) for i in rows)
      bucket = self.length_bucket
      length = min(-(-longest // bucket) * bucket, self.source_max_length)
      inputs = np.zeros((batch_size, max(length, longest)), np.int32)
      for row, i in enumerate(rows):
        ids = encoded[i][0]
        inputs[row, : len(ids)] = ids
      search = self._compiled_search(inputs.shape)
      tic, tic_cpu = time.perf_counter(), time.process_time()
      global_inputs = jax.make_array_from_callback(
          inputs.shape, self._sharding, lambda index, x=inputs: x[index]
      )
      with self.s.activate():
        result = search(self.params, global_inputs)
      result.block_until_ready()
      self.timing.search_secs += time.perf_counter() - tic
      self.timing.search_cpu_secs += time.process_time() - tic_cpu
      result = np.asarray(multihost_utils.process_allgather(result, tiled=True))
      for row, i in enumerate(rows):
        text = self.tokenizer.decode(strip(result[row], self.tokenizer.eos_id))
        out[i] = text.replace('\r', ' ').replace('\n', ' ')  # one line per translation
      done += len(rows)
      self.timing.batches += 1
      if progress is not None:
        progress(done, len(texts))
    self.timing.sentences += len(texts)
    self.timing.total_secs += time.perf_counter() - start
    self.timing.total_cpu_secs += time.process_time() - start_cpu
    return Translations(out, truncated)


def score(hypotheses: Sequence[str], references: Sequence[str]) -> dict[str, float | str]:
  """sacreBLEU corpus BLEU (cased, 13a tokenization of detokenized text) and chrF.

  Returns 'bleu', 'chrf', 'sentences' and, as strings, 'bleu_signature', 'chrf_signature'
  and 'bleu_summary' (sacrebleu's line: n-gram precisions, brevity penalty, lengths).
  """
  if len(hypotheses) != len(references):
    raise ValueError(f'{len(hypotheses)} translations but {len(references)} references.')
  bleu, chrf = sacrebleu.metrics.BLEU(), sacrebleu.metrics.CHRF()
  bleu_score = bleu.corpus_score(list(hypotheses), [list(references)])
  chrf_score = chrf.corpus_score(list(hypotheses), [list(references)])
  return {
      'bleu': bleu_score.score,
      'chrf': chrf_score.score,
      'sentences': float(len(hypotheses)),
      'bleu_signature': str(bleu.get_signature()),
      'chrf_signature': str(chrf.get_signature()),
      'bleu_summary': bleu_score.format(width=2),
  }
