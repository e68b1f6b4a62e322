"""Pretrained BERT weights (Hugging Face layout) into `EncoderMLM`.

    import json, safetensors.numpy
    cfg = bert_config(json.load(open(path / 'config.json')))
    model = EncoderMLM(cfg, rngs=nnx.Rngs(0))
    unused = load_bert_weights(model, safetensors.numpy.load_file(path / 'model.safetensors'))

Works for any BERT-architecture checkpoint (BERT, MiniLM, ...). Attention can be made
collaborative afterwards by re-parametrizing the loaded concat layers
(`lowrank_attn.reparam.to_collaborative`).

A sentence-transformers model (all-MiniLM-L6-v2) is a sentence encoder: token states pooled as
its `1_Pooling/config.json` says, then L2-normalised if its `modules.json` ends with a
Normalize module; `sentence_pooling(path)` reads that and `sentence_embeddings` applies it.
"""

from collections.abc import Mapping
import functools
import json
import os
import pathlib
from typing import Any, NamedTuple

from flax import nnx
import jax
import jax.numpy as jnp
import numpy as np

from lowrank_attn.attention import AttentionSpec
from lowrank_attn.models.config import TransformerConfig
from lowrank_attn.models.transformer import EncoderMLM


def bert_config(hf_config: Mapping[str, Any], **overrides) -> TransformerConfig:
  """The `TransformerConfig` of a Hugging Face BERT `config.json`."""
  if hf_config.get('model_type', 'bert') != 'bert':
    raise ValueError(f"model_type={hf_config.get('model_type')!r}: only BERT checkpoints.")
  if hf_config.get('position_embedding_type', 'absolute') != 'absolute':
    raise ValueError('only absolute (learned) position embeddings are supported.')
  act = {'gelu': 'gelu_exact', 'gelu_new': 'gelu', 'relu': 'relu'}.get(hf_config['hidden_act'])
  if act is None:
    raise ValueError(f"hidden_act={hf_config['hidden_act']!r} is not supported.")
  attention = AttentionSpec(
      num_heads=hf_config['num_attention_heads'],
      dropout_rate=hf_config.get('attention_probs_dropout_prob', 0.0),
  )
  fields = dict(
      vocab_size=hf_config['vocab_size'],
      emb_dim=hf_config['hidden_size'],
      mlp_dim=hf_config['intermediate_size'],
      num_encoder_layers=hf_config['num_hidden_layers'],
      num_decoder_layers=0,
      encoder_attention=attention,
      max_length=hf_config['max_position_embeddings'],
      positions='learned',
      norm='post',
      activation=act,
      dropout_rate=hf_config.get('hidden_dropout_prob', 0.0),
      tie_embeddings=True,
      scale_embeddings=False,
      type_vocab_size=hf_config.get('type_vocab_size', 0),
      layer_norm_epsilon=hf_config.get('layer_norm_eps', 1e-12),
  )
  fields.update(overrides)
  return TransformerConfig(**fields)


def _linear(get, name, heads=None, split_input=False):
  """torch Linear weight [out, in] -> our kernel [in, out] (optionally split into heads)."""
  kernel = get(f'{name}.weight').T
  bias = get(f'{name}.bias')
  if heads is not None and not split_input:  # q/k/v: [D, heads, head_dim]
    kernel = kernel.reshape(kernel.shape[0], heads, -1)
    bias = bias.reshape(heads, -1)
  if heads is not None and split_input:  # attention output: [heads, head_dim, D]
    kernel = kernel.reshape(heads, -1, kernel.shape[-1])
  return kernel, bias


def load_bert_weights(model, tensors: Mapping[str, np.ndarray]) -> list[str]:
  """Copies a BERT state dict into an `EncoderMLM` built from `bert_config`; in place.

  Returns the checkpoint entries that were not used (e.g. `pooler.*`); the MLM head
  (`cls.predictions.*`) is loaded when present and otherwise keeps its initialisation.
  Raises ValueError on a shape mismatch or a missing encoder tensor.
  """
  used = set()

  def get(name):
    if name not in tensors:
      raise ValueError(f'checkpoint has no {name!r}')
    used.add(name)
    return tensors[name]

  def put(variable, value, name):
    value = np.asarray(value, np.float32)
    if tuple(variable.get_value().shape) != value.shape:
      raise ValueError(
          f'{name}: checkpoint shape {value.shape} != model shape '
          f'{tuple(variable.get_value().shape)}'
      )
    variable.set_value(value.astype(variable.get_value().dtype))

  embedding = model.encoder.embedding
  put(model.tokens.embed.embedding, get('embeddings.word_embeddings.weight'), 'word embeddings')
  put(embedding.position_table, get('embeddings.position_embeddings.weight'), 'positions')
  if embedding.token_types is not None:
    put(
        embedding.token_types.embedding,
        get('embeddings.token_type_embeddings.weight'),
        'token types',
    )
  put(embedding.norm.scale, get('embeddings.LayerNorm.weight'), 'embedding LayerNorm')
  put(embedding.norm.bias, get('embeddings.LayerNorm.bias'), 'embedding LayerNorm')
  for i, layer in enumerate(model.encoder.layers):
    prefix = f'encoder.layer.{i}'
    attention = layer.self_attention
    if attention.spec.kind != 'concat':
      raise ValueError(f'layer {i}: load BERT weights into kind=concat attention, then convert.')
    heads = attention.spec.num_heads
    for ours, theirs in (('query', 'query'), ('key', 'key'), ('value', 'value')):
      kernel, bias = _linear(get, f'{prefix}.attention.self.{theirs}', heads)
      put(getattr(attention, f'{ours}_kernel'), kernel, f'{prefix} {ours}')
      put(getattr(attention, f'{ours}_bias'), bias, f'{prefix} {ours}')
    kernel, bias = _linear(get, f'{prefix}.attention.output.dense', heads, split_input=True)
    put(attention.out_kernel, kernel, f'{prefix} attention output')
    put(attention.out_bias, bias, f'{prefix} attention output')
    put(layer.self_attention_norm.scale, get(f'{prefix}.attention.output.LayerNorm.weight'), prefix)
    put(layer.self_attention_norm.bias, get(f'{prefix}.attention.output.LayerNorm.bias'), prefix)
    for dense, theirs in ((layer.mlp.wi, 'intermediate.dense'), (layer.mlp.wo, 'output.dense')):
      kernel, bias = _linear(get, f'{prefix}.{theirs}')
      put(dense.kernel, kernel, f'{prefix} {theirs}')
      put(dense.bias, bias, f'{prefix} {theirs}')
    put(layer.mlp_norm.scale, get(f'{prefix}.output.LayerNorm.weight'), prefix)
    put(layer.mlp_norm.bias, get(f'{prefix}.output.LayerNorm.bias'), prefix)
  if 'cls.predictions.bias' in tensors:  # the MLM head (BertForMaskedLM checkpoints)
    kernel, bias = _linear(get, 'cls.predictions.transform.dense')
    put(model.head_dense.kernel, kernel, 'MLM head')
    put(model.head_dense.bias, bias, 'MLM head')
    put(model.head_norm.scale, get('cls.predictions.transform.LayerNorm.weight'), 'MLM head')
    put(model.head_norm.bias, get('cls.predictions.transform.LayerNorm.bias'), 'MLM head')
    put(model.output_bias, get('cls.predictions.bias'), 'MLM head')
    used.add('cls.predictions.decoder.weight')  # tied to the word embeddings
    used.add('cls.predictions.decoder.bias')
  return sorted(set(tensors) - used)


class Pooling(NamedTuple):
  """How a sentence-transformers model turns token states into one sentence embedding."""

  mode: str = 'mean'  # 'mean' (over non-padding tokens) | 'cls' | 'max'
  normalize: bool = True  # L2-normalise the pooled vector


# sentence-transformers' Pooling config keys -> our modes.
_POOLING_KEYS = {
    'pooling_mode_mean_tokens': 'mean',
    'pooling_mode_cls_token': 'cls',
    'pooling_mode_max_tokens': 'max',
}


def sentence_pooling(model_dir: str | os.PathLike) -> Pooling:
  """The pooling of a sentence-transformers model directory (its modules.json and pooling
  config); ValueError for a pooling we do not implement."""
  model_dir = pathlib.Path(model_dir)
  modules = json.loads((model_dir / 'modules.json').read_text())
  types = [module['type'].rsplit('.', 1)[-1] for module in modules]
  if 'Pooling' not in types:
    raise ValueError(f'{model_dir / "modules.json"} has no Pooling module (modules: {types}).')
  pooling_dir = model_dir / modules[types.index('Pooling')]['path']
  config = json.loads((pooling_dir / 'config.json').read_text())
  chosen = [key for key, value in config.items() if key.startswith('pooling_mode') and value]
  if len(chosen) != 1 or chosen[0] not in _POOLING_KEYS:
    raise ValueError(
        f'{pooling_dir / "config.json"}: pooling {chosen} is not supported; one '
        f'of {sorted(_POOLING_KEYS)} must be set.'
    )
  return Pooling(mode=_POOLING_KEYS[chosen[0]], normalize=types[-1] == 'Normalize')


def sentence_embeddings(model, inputs: jax.Array, pooling: Pooling = Pooling()) -> jax.Array:
  """Sentence embeddings `[batch, D]` float32 of token ids `[batch, length]` (0 = padding,
  each row `[CLS] ... [SEP]`) by an `EncoderMLM`'s final hidden states and `pooling`."""
  hidden, _ = model.encode(inputs)
  hidden = hidden.astype(jnp.float32)
  valid = (inputs != 0)[..., None]
  if pooling.mode == 'mean':
    pooled = jnp.sum(hidden * valid, axis=1) / jnp.maximum(jnp.sum(valid, axis=1), 1)
  elif pooling.mode == 'cls':
    pooled = hidden[:, 0]
  elif pooling.mode == 'max':
    pooled = jnp.max(jnp.where(valid, hidden, -jnp.inf), axis=1)
  else:
    raise ValueError(f'pooling mode {pooling.mode!r} is not one of {set(_POOLING_KEYS.values())}.')
  if pooling.normalize:  # as torch.nn.functional.normalize: x / max(|x|, 1e-12)
    pooled = pooled / jnp.maximum(jnp.linalg.norm(pooled, axis=-1, keepdims=True), 1e-12)
  return pooled


BUCKETS = (16, 32, 64, 128, 256)  # padded lengths of `embed_sentences`: few compilations
ROWS_PER_CALL = 250  # sentences per compiled call of `embed_sentences`


def padded(rows: list[list[int]], rows_per_batch: int, buckets=BUCKETS) -> np.ndarray:
  """`[rows_per_batch, length]` int32 token ids (0 = padding), length the smallest bucket
  that holds the longest row; missing rows are all padding."""
  longest = max(len(r) for r in rows)
  length = next((b for b in buckets if b >= longest), None)
  if length is None:
    raise ValueError(f'a row of {longest} tokens is longer than the largest bucket {buckets[-1]}.')
  out = np.zeros((rows_per_batch, length), np.int32)
  for i, row in enumerate(rows):
    out[i, : len(row)] = row
  return out


@functools.partial(jax.jit, static_argnames=('graphdef', 'pooling'))
def _embed_batch(graphdef, state, batch, pooling):
  return sentence_embeddings(nnx.merge(graphdef, state), batch, pooling)


def embed_sentences(model, pooling: Pooling, ids: list[list[int]], buckets=BUCKETS) -> np.ndarray:
  """Sentence embeddings `[len(ids), D]` float32 of token-id rows (`[CLS] ... [SEP]`), in
  their order.

  Rows are sorted by length and embedded `ROWS_PER_CALL` at a time, padded to the smallest
  bucket that holds the call's longest: one compilation per model structure and bucket. The
  padding is masked, so this computes what padding every row to one length computes (up to
  float rounding), in a fraction of the time for short sentences.
  """
  graphdef, state = nnx.split(model)
  order = np.argsort([len(row) for row in ids], kind='stable')
  out = np.zeros((len(ids), model.cfg.emb_dim), np.float32)
  for start in range(0, len(ids), ROWS_PER_CALL):
    chosen = order[start : start + ROWS_PER_CALL]
    batch = padded([ids[i] for i in chosen], ROWS_PER_CALL, buckets)
    out[chosen] = np.asarray(_embed_batch(graphdef, state, batch, pooling))[: len(chosen)]
  return out


def load_pretrained(model_dir: str | os.PathLike, **overrides):
  """An `EncoderMLM` holding a Hugging Face BERT directory's weights (`config.json`,
  `model.safetensors`); `overrides` change `TransformerConfig` fields (e.g. dropout_rate)."""
  import safetensors.numpy  # pylint: disable=g-import-not-at-top  (a [dev] dependency)

  model_dir = pathlib.Path(model_dir)
  cfg = bert_config(json.loads((model_dir / 'config.json').read_text()), **overrides)
  model = EncoderMLM(cfg, rngs=nnx.Rngs(0))
  load_bert_weights(model, safetensors.numpy.load_file(str(model_dir / 'model.safetensors')))
  return model
