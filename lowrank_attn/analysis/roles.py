"""Head roles (Voita et al. 2019, sec. 5): positional, syntactic and rare-word heads.

    sentences = read_treebank(['en_ewt-ud-dev.conllu'])
    result = head_roles(model, tokenizer, sentences, word_counts(training_texts))
    labels = [classify(entry, result['baselines']) for entry in result['heads']]

Subword attention becomes word attention as Voita et al. map BPE to words: a query word's
row is the mean over its pieces of the summed weight on each key word's pieces (sum over a
word's key pieces, mean over its query pieces). Special tokens (BOS/EOS, [CLS]/[SEP]) belong
to no word: the weight on them is dropped. Per head, over the words of a treebank:

  positional  share of words whose most-attended word is the previous (next) word, among the
              words that have one; Voita et al. call a head positional at >= 90%.
  syntactic   for each relation of `RELATIONS` (universal relation: subtypes like nmod:poss
              count as nmod) and direction (dependent -> head, head -> dependent): the share of
              query words whose most-attended word is the gold head (one of the gold
              dependents); next to the best fixed-offset baseline (most frequent relative
              position of the relation). Voita et al. call a head syntactic for a relation at
              >= 10% over that baseline; we take 10 points (absolute).
  rare        share of sentences whose most-attended word (largest mean weight over the
              sentence's query words) is the rarest word of the sentence by training-corpus
              count, over the sentences with one rarest word (ties would reward chance);
              next to chance (the mean of 1 / words over those sentences) and to a uniform
              head: summing over key pieces, a head that attends to every piece alike
              attends most to the word of most pieces, and rare words split into more
              pieces (ties split evenly). Voita et al. give no threshold; we call a head
              rare-word at >= 50% and >= 10 points over the uniform head (ours).
  confidence  mean over word pieces of the largest weight on a word piece (specials excluded,
              as Voita et al. exclude EOS).

Sentences whose words cannot be aligned to the tokenizer's pieces (a word not found in the
sentence text, or a piece spanning two words) are skipped and counted, and so are sentences
longer than the model's learned positions.
"""

from collections.abc import Callable, Iterable, Mapping, Sequence
import collections
import dataclasses
import functools
import re

from flax import nnx
import jax
import jax.numpy as jnp
import numpy as np

from lowrank_attn import models, pruning
from lowrank_attn.data.builders.ud_english_ewt import Sentence, parse_conllu

RELATIONS = ('nsubj', 'obj', 'amod', 'advmod', 'nmod', 'compound', 'det', 'case')
DIRECTIONS = ('dep->head', 'head->dep')
POSITIONAL_THRESHOLD = 0.9  # Voita et al.
SYNTACTIC_MARGIN = 0.10  # over the fixed-offset baseline; Voita et al.'s "10%", as points
RARE_THRESHOLD = 0.5  # ours: Voita et al. name no threshold
RARE_MARGIN = 0.10  # ours: over a uniform head, which favours words of many pieces
MAX_OFFSET = 10  # fixed-offset baselines try relative positions -10..10 (not 0)


def read_treebank(paths: Iterable[str]) -> list[Sentence]:
  """The sentences of CoNLL-U files (basic dependencies; multiword-token lines dropped)."""
  return [sentence for path in paths for sentence in parse_conllu(path)]


def word_pieces(encode: Callable[[str], list[int]], sentence: Sentence) -> list[list[int]] | None:
  """Each word's piece ids as `encode` tokenizes the whole sentence text; None if unaligned.

  Word k's pieces are those the tokenization of the text up to the end of word k adds to the
  tokenization of the text up to the end of word k - 1 (so the pieces are exactly the ones the
  model sees for the raw sentence).
  """
  text, position, ends = sentence.text, 0, []
  for word in sentence.tokens:
    start = text.find(word, position)
    if start < 0 or text[position:start].strip():
      return None
    position = start + len(word)
    ends.append(position)
  pieces, previous = [], []
  for end in ends:
    ids = encode(text[:end])
    if ids[: len(previous)] != previous or len(ids) == len(previous):
      return None
    pieces.append(ids[len(previous) :])
    previous = ids
  if encode(text) != previous:  # text after the last word changed the last pieces
    return None
  return pieces


def word_attention(weights: np.ndarray, word_of_piece: np.ndarray, num_words: int) -> np.ndarray:
  """`[heads, pieces, pieces]` -> `[heads, words, words]`: the sum over a key word's pieces,
  the mean over a query word's pieces. `word_of_piece[p]` is -1 for special tokens."""
  onehot = np.zeros((len(word_of_piece), num_words))
  real = word_of_piece >= 0
  onehot[np.flatnonzero(real), word_of_piece[real]] = 1.0
  summed = np.einsum('pw,hpq,qv->hwv', onehot, weights, onehot)
  return summed / onehot.sum(0)[None, :, None]


@dataclasses.dataclass
class _Counts:
  """Running numerators and denominators of every metric, per layer and head."""

  layers: int
  heads: int

  def __post_init__(self):
    zeros = lambda: np.zeros((self.layers, self.heads))
    self.prev, self.next, self.confidence = zeros(), zeros(), zeros()
    self.rare = zeros()
    self.syntactic = collections.defaultdict(zeros)
    self.words_with_prev = self.words_with_next = self.pieces = self.sentences = 0
    self.rare_sentences, self.rare_chance = 0, 0.0  # sentences with one rarest word
    self.rare_uniform = 0.0  # ... where a uniform head's most-attended word is the rarest
    self.queries = collections.Counter()  # (relation, direction) -> query words
    self.offsets = collections.defaultdict(collections.Counter)  # -> relative position counts


def _gold_targets(sentence: Sentence) -> dict[tuple[str, str], dict[int, set[int]]]:
  """{(relation, direction): {query word: its gold target words}} (0-based words)."""
  targets = collections.defaultdict(lambda: collections.defaultdict(set))
  for dependent, (head, relation) in enumerate(zip(sentence.heads, sentence.deprels)):
    relation = relation.split(':')[0]
    if relation not in RELATIONS or head == 0:
      continue
    targets[relation, 'dep->head'][dependent].add(head - 1)
    targets[relation, 'head->dep'][head - 1].add(dependent)
  return targets


def _count_sentence(
    counts: _Counts,
    words: np.ndarray,
    piece_weights: np.ndarray,
    word_of_piece: np.ndarray,
    sentence: Sentence,
    rarest: int | None,
) -> None:
  """Adds one sentence: words `[layers, heads, n, n]` word attention, piece_weights
  `[layers, heads, pieces, pieces]`."""
  n = words.shape[-1]
  top = np.argmax(words, axis=-1)  # [layers, heads, n]: most-attended word of each query
  index = np.arange(n)
  counts.prev += np.sum(top[..., 1:] == index[1:] - 1, axis=-1)
  counts.next += np.sum(top[..., :-1] == index[:-1] + 1, axis=-1)
  counts.words_with_prev += n - 1
  counts.words_with_next += n - 1
  for key, queries in _gold_targets(sentence).items():
    for query, targets in queries.items():
      counts.syntactic[key] += np.isin(top[..., query], list(targets))
      counts.queries[key] += 1
      for target in targets:
        counts.offsets[key][target - query] += 1
  if rarest is not None:
    attended = np.argmax(words.mean(axis=-2), axis=-1)  # [layers, heads]
    counts.rare += attended == rarest
    counts.rare_sentences += 1
    counts.rare_chance += 1 / n
    pieces_per_word = np.bincount(word_of_piece[word_of_piece >= 0], minlength=n)
    most = np.flatnonzero(pieces_per_word == pieces_per_word.max())
    counts.rare_uniform += (rarest in most) / len(most)
  counts.sentences += 1
  real = word_of_piece >= 0
  keys = piece_weights[..., real][..., real, :]  # real queries x real keys
  counts.confidence += keys.max(axis=-1).sum(axis=-1)
  counts.pieces += int(real.sum())


def _baseline(offsets: collections.Counter, queries: int) -> tuple[int, float]:
  """(relative position, accuracy) of the best fixed offset: the most frequent one."""
  allowed = {k: v for k, v in offsets.items() if k and abs(k) <= MAX_OFFSET}
  if not allowed or not queries:
    return 0, 0.0
  # For head->dep with several gold dependents a query counts once per offset it matches.
  offset = max(sorted(allowed), key=allowed.get)
  return offset, allowed[offset] / queries


def normalize_word(word: str) -> str:
  """How words are counted for rarity: lowercased, surrounding punctuation kept."""
  return word.lower()


def word_counts(texts: Iterable[str]) -> collections.Counter:
  """Training-corpus word counts: texts split at whitespace and punctuation, lowercased."""
  counts = collections.Counter()
  for text in texts:
    counts.update(normalize_word(w) for w in re.findall(r'\w+|[^\w\s]', text))
  return counts


@functools.partial(jax.jit, static_argnames=('graphdef',))
def _encoder_weights(graphdef, params, inputs):
  """`[batch, layers, heads, length, length]` encoder self-attention weights."""
  model = nnx.merge(graphdef, params)
  _, extras = model.encode(inputs, return_weights=True)
  return jnp.stack(extras['attention_weights']['encoder'], axis=1)


def with_specials(model, tokenizer) -> Callable[[list[int]], tuple[list[int], int]]:
  """`piece ids -> (encoder input, index of the first piece)` as the model was trained:
  BERT-style `[CLS] ids [SEP]`, translation sources `ids EOS`."""
  if isinstance(model, models.EncoderMLM):
    return lambda ids: ([tokenizer.bos_id, *ids, tokenizer.eos_id], 1)
  return lambda ids: ([*ids, tokenizer.eos_id], 0)


def head_roles(
    model: nnx.Module,
    tokenizer,
    sentences: Sequence[Sentence],
    counts: Mapping[str, int],
    *,
    batch_size: int = 32,
    length_bucket: int = 16,
) -> dict:
  """Role metrics of every encoder self-attention head on treebank sentences.

  Args:
    model: an `EncoderDecoder` (its encoder) or `EncoderMLM`, every layer with as many heads.
    tokenizer: the model's tokenizer (`encode`, `bos_id`, `eos_id`).
    sentences: treebank sentences (`read_treebank`).
    counts: training-corpus word counts (`word_counts`), keyed by `normalize_word`.
    batch_size: sentences per encoder call; rows are padded to a multiple of `length_bucket`.

  Returns:
    {'heads': [per layer and head: {'layer', 'head', 'confidence', 'positional': {'prev',
    'next'}, 'syntactic': {'<relation> <direction>': accuracy}, 'rare'}], 'baselines':
    {'<relation> <direction>': {'offset', 'accuracy', 'queries'}, 'rare': {'chance',
    'uniform', 'sentences'}}, 'sentences': used,
    'skipped': {'unaligned': sentences, 'too_long': sentences over the model's positions}}.
  """
  heads = {a.num_heads for a in model.attention_layers()['encoder']}
  if len(heads) != 1 or 0 in heads:
    raise ValueError(
        f'head_roles needs the same number of heads in every encoder layer, got '
        f'{pruning.head_counts(model)["encoder"]}.'
    )
  add_specials = with_specials(model, tokenizer)
  longest = model.cfg.max_length if model.cfg.positions == 'learned' else None
  aligned, skipped = [], {'unaligned': 0, 'too_long': 0}
  for sentence in sentences:
    pieces = word_pieces(tokenizer.encode, sentence)
    if pieces is None:
      skipped['unaligned'] += 1
    elif longest and len(add_specials(sum(pieces, []))[0]) > longest:
      skipped['too_long'] += 1
    else:
      aligned.append((sentence, pieces))
  if not aligned:
    raise ValueError(
        f'none of the {len(sentences)} sentences aligns with the tokenizer and '
        f'fits the model (skipped: {skipped}).'
    )

  graphdef, params = nnx.split(model, nnx.Param)

  def attended():
    for first in range(0, len(aligned), batch_size):
      chunk = aligned[first : first + batch_size]
      rows, words_of_pieces = [], []
      for sentence, pieces in chunk:
        ids, position = add_specials([p for word in pieces for p in word])
        word_of_piece = np.full(len(ids), -1)
        for w, word in enumerate(pieces):
          word_of_piece[position : position + len(word)] = w
          position += len(word)
        rows.append(ids)
        words_of_pieces.append(word_of_piece)
      length = -(-max(map(len, rows)) // length_bucket) * length_bucket
      inputs = np.zeros((batch_size, length), np.int32)  # a fixed batch: one compilation
      for i, ids in enumerate(rows):
        inputs[i, : len(ids)] = ids
      weights = np.asarray(_encoder_weights(graphdef, params, jnp.asarray(inputs)))
      for (sentence, _), ids, word_of_piece, w in zip(chunk, rows, words_of_pieces, weights):
        yield sentence, w[..., : len(ids), : len(ids)], word_of_piece

  return {**roles_from_attention(attended(), counts), 'skipped': skipped}


def roles_from_attention(
    attended: Iterable[tuple[Sentence, np.ndarray, np.ndarray]], counts: Mapping[str, int]
) -> dict:
  """The metrics of `head_roles` from (sentence, piece attention `[layers, heads, pieces,
  pieces]`, word of each piece (-1: special token)) triples."""
  counted = None
  for sentence, weights, word_of_piece in attended:
    weights = np.asarray(weights, np.float64)
    if counted is None:
      counted = _Counts(*weights.shape[:2])
    n, length = len(sentence.tokens), weights.shape[-1]
    words = word_attention(weights.reshape(-1, length, length), np.asarray(word_of_piece), n)
    words = words.reshape(*weights.shape[:2], n, n)
    frequency = [counts.get(normalize_word(t), 0) for t in sentence.tokens]
    rarest = [i for i, f in enumerate(frequency) if f == min(frequency)]
    _count_sentence(
        counted,
        words,
        weights,
        np.asarray(word_of_piece),
        sentence,
        rarest[0] if len(rarest) == 1 else None,
    )
  if counted is None:
    raise ValueError('no sentence to compute head roles on.')
  return _summarise(counted)


def _summarise(c: _Counts) -> dict:
  keys = [(r, d) for r in RELATIONS for d in DIRECTIONS if c.queries[r, d]]
  name = lambda key: f'{key[0]} {key[1]}'
  heads = []
  for layer in range(c.layers):
    for head in range(c.heads):
      heads.append(
          {
              'layer': layer,
              'head': head,
              'confidence': c.confidence[layer, head] / max(c.pieces, 1),
              'positional': {
                  'prev': c.prev[layer, head] / max(c.words_with_prev, 1),
                  'next': c.next[layer, head] / max(c.words_with_next, 1),
              },
              'syntactic': {name(k): c.syntactic[k][layer, head] / c.queries[k] for k in keys},
              'rare': c.rare[layer, head] / max(c.rare_sentences, 1),
          }
      )
  baselines = {}
  for key in keys:
    offset, accuracy = _baseline(c.offsets[key], c.queries[key])
    baselines[name(key)] = {'offset': offset, 'accuracy': accuracy, 'queries': c.queries[key]}
  baselines['rare'] = {
      'chance': c.rare_chance / max(c.rare_sentences, 1),
      'uniform': c.rare_uniform / max(c.rare_sentences, 1),
      'sentences': c.rare_sentences,
  }
  return {'heads': heads, 'baselines': baselines, 'sentences': c.sentences}


def classify(entry: Mapping, baselines: Mapping) -> list[str]:
  """The roles a head's metrics give it by the thresholds above: 'positional (prev|next)',
  'syntactic (<relation> <direction>)', 'rare'."""
  roles = [
      f'positional ({side})'
      for side in ('prev', 'next')
      if entry['positional'][side] >= POSITIONAL_THRESHOLD
  ]
  roles += [
      f'syntactic ({key})'
      for key, accuracy in entry['syntactic'].items()
      if accuracy >= baselines[key]['accuracy'] + SYNTACTIC_MARGIN
  ]
  if entry['rare'] >= max(RARE_THRESHOLD, baselines['rare']['uniform'] + RARE_MARGIN):
    roles.append('rare')
  return roles
