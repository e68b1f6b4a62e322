"""tpu/compile.py: the real train step compiled for a TPU slice on this machine.

The compiles need libtpu (`make test-tpu` installs it in its own virtualenv) and are skipped,
saying so, where it is missing; the batch spec and the "does not fit" error need no libtpu.
"""

import importlib.util
import pathlib
import re

import jax
import jax.numpy as jnp
import pytest

from lowrank_attn import chips
from lowrank_attn import data
from lowrank_attn import tasks
from lowrank_attn.attention import dispatch
from lowrank_attn.train import config as config_lib, state as state_lib
from tpu import compile as compile_tool

ROOT = pathlib.Path(__file__).resolve().parents[2]
HAS_LIBTPU = importlib.util.find_spec('libtpu') is not None
needs_libtpu = pytest.mark.skipif(
    not HAS_LIBTPU,
    reason="libtpu is not installed (pip install -e '.[tpu]', or run "
    '`make test-tpu`, which installs it in .venv-tpu)',
)


def tiny(task):
  return config_lib.load(f'{ROOT}/configs/{task}.py:tiny')


def test_batch_spec_is_the_training_pipelines(tmp_path):
  """Keys, shapes and dtypes as the real pipeline gives them (here on 2 devices)."""
  config = tiny('lm')
  config.data.name = 'tiny_shakespeare'  # in the shared data directory: quick to prepare
  pipeline = tasks.make_pipeline(
      config.data,
      split='train',
      seed=0,
      train=True,
      global_batch_size=2 * config.per_device_batch_size,
      workdir=str(tmp_path),
  )
  assert compile_tool.batch_spec(config, num_devices=2) == pipeline.element_spec


def test_batch_spec_of_packed_translation():
  config = tiny('nmt')
  config.grad_accum_steps = 2
  spec = compile_tool.batch_spec(config, num_devices=4)
  assert set(spec) == {
      'inputs',
      'targets',
      'weights',
      'inputs_segment_ids',
      'inputs_positions',
      'targets_segment_ids',
      'targets_positions',
  }
  assert {s.shape for s in spec.values()} == {
      (4 * 2 * config.per_device_batch_size, config.data.max_length)
  }
  config.data.packing = False
  assert set(compile_tool.batch_spec(config, num_devices=4)) == {'inputs', 'targets', 'weights'}


def test_topology_names_are_checked():
  with pytest.raises(ValueError, match=r"--topology='v5e-16' is not chip:shape"):
    compile_tool.topology_devices('v5e-16')


# An excerpt of the error XLA's TPU compiler raises when a program does not fit.
XLA_OOM = """RESOURCE_EXHAUSTED: XLA:TPU compile permanent error. Ran out of memory in memory \
space hbm. Used 21.09G of 15.75G hbm. Exceeded hbm capacity by 5.34G.

Total hbm usage >= 21.34G:
    reserved        258.00M
    program          21.09G
    arguments            0B

Largest program allocations in hbm:

  1. Size: 8.00G
     Operator: op_name="jit(train_step)/dot_general"
     Shape: f32[65536,128,256]{2,1,0:T(8,128)}
     Unpadded size: 8.00G
     XLA label: fusion.12 = fusion(param.1, param.2)
     Allocation type: HLO temp
     ==========================

  2. Size: 4.00G
     Operator: op_name="jit(train_step)/softmax"
     Shape: f32[65536,4,128,128]{3,2,1,0:T(8,128)}
     Allocation type: HLO temp
     ==========================

  3. Size: 1.00G
     Shape: s32[65536,128]
     Allocation type: HLO temp
"""


def test_does_not_fit_names_the_biggest_buffers():
  largest = compile_tool.largest_buffers(XLA_OOM, count=2)
  assert len(largest) == 2
  assert largest[0].startswith('1. Size: 8.00G') and 'f32[65536,128,256]' in largest[0]
  assert 'dot_general' in largest[0] and 'HLO temp' in largest[0]
  assert largest[1].startswith('2. Size: 4.00G') and 'softmax' in largest[1]
  needed = compile_tool._needed_bytes(XLA_OOM)
  assert needed == int(21.09 * 2**30)
  message = compile_tool.does_not_fit_message(
      'configs/lm.py', 'v5e:2x2', chips.CHIPS['v5e'], needed, largest
  )
  first, *rest = message.splitlines()
  assert first == (
      'configs/lm.py on v5e:2x2: the train step needs 21.09 GiB per chip; a v5e '
      'chip has 16.00 GiB of HBM. Biggest buffers:'
  )
  assert rest[0] == '  ' + largest[0]
  assert 'per_device_batch_size' in rest[-1]


def test_without_xla_allocations_the_biggest_arrays_of_the_program_are_named():
  """The fallback (libtpu 0.0.42's error lists no allocations): the lowered step's biggest
  arrays, here on CPU, where the attention weights [batch, heads, L, L] are the biggest."""
  config = tiny('lm')
  s = state_lib.setup(config, vocab_size=256, bos_id=1, devices=jax.devices()[:1])
  lowered, _ = state_lib.lower_steps(s, compile_tool.batch_spec(config, num_devices=1))
  largest = compile_tool.largest_values(lowered.as_text(debug_info=True), count=3)
  b, h, n = config.per_device_batch_size, config.model.attention.num_heads, config.data.max_length
  assert len(largest) == 3
  assert largest[0].startswith(f'{b * h * n * n * 4 / 2**20:.1f} MiB f32[{b},{h},{n},{n}] ')
  assert 'lowrank_attn/attention/' in largest[0], largest


def test_a_report_over_hbm_does_not_fit():
  """When XLA compiles but memory_analysis exceeds the published HBM, the same error."""
  memory = {
      'argument_size_in_bytes': 6 * 2**30,
      'output_size_in_bytes': 6 * 2**30,
      'alias_size_in_bytes': 6 * 2**30,
      'temp_size_in_bytes': 11 * 2**30,
      'generated_code_size_in_bytes': 2**20,
  }
  report = compile_tool.Report(
      name='x',
      topology='v5e:2x2',
      chip=chips.CHIPS['v5e'],
      num_chips=4,
      mesh={'data': 4},
      memory=memory,
      xla_flops=1e12,
      analytic_flops=3.6e12,
      xla_seconds=0.01,
      xla_bytes=1e10,
      tokens_per_step=4096,
      compile_secs=1.0,
  )
  assert report.hbm_bytes == 17 * 2**30 + 2**20 and not report.fits
  assert compile_tool._largest_from_memory(memory)[0] == 'temp: 11.00 GiB'
  # MFU = analytic FLOPs / step time / (chips x published peak).
  assert report.mfu == pytest.approx(3.6e12 / 0.01 / (4 * 197e12))
  assert report.tokens_per_sec == pytest.approx(409_600)
  # Without XLA's estimate, the roofline: here memory-bound (10 GB at 819 GB/s: 12 ms; 1 TFLOP
  # at 197 TFLOP/s: 5 ms).
  report.xla_seconds = None
  assert report.step_secs == pytest.approx(1e10 / 819e9) and 'roofline' in report.step_secs_source


@needs_libtpu
@pytest.mark.slow
@pytest.mark.parametrize('task', ['lm', 'mlm', 'nmt'])
def test_tiny_configs_compile_for_v5e_2x2(task):
  config = tiny(task)
  assert config.model.dtype == 'auto' and config.model.attention.implementation == 'auto'
  report = compile_tool.compile_train_step(config, 'v5e:2x2', name=f'{task}:tiny')
  print(report.describe())
  assert report.chip is chips.CHIPS['v5e'] and report.num_chips == 4
  # dtype='auto' on TPU: the compiled program multiplies bfloat16. The only float32 operand
  # allowed is the float32 logits' cotangent in the backward pass of the 'xla' path's q.k.
  assert report.dtype == 'bfloat16'
  counts = report.matmul_dtypes
  assert counts.get('bf16 x bf16', 0) > 0.8 * sum(counts.values()), counts
  assert 'f32 x f32' not in counts, counts
  # implementation='auto': the program has splash's kernels exactly where 'auto' picks splash
  # for these rows on a TPU (lm, mlm: 128 tokens; nmt: 32, too short for a 128-wide block).
  length, rows = config.data.max_length, config.per_device_batch_size
  spec = config_lib.model_config(config, vocab_size=1000).attention(
      tasks.get(task).attention_types[0], 0
  )
  chosen = dispatch.choose_implementation(
      spec, q_length=length, kv_length=length, batch=rows, dtype=jnp.bfloat16, platform='tpu'
  )
  assert chosen == ('xla' if task == 'nmt' else 'splash')
  assert report.attention == chosen, report.kernels
  if chosen == 'splash':  # forward and both backward kernels
    assert {k.split('_segmented')[0] for k in report.kernels} == {
        'splash_mha_fwd',
        'splash_mha_dq',
        'splash_mha_dkv',
    }, report.kernels
  assert report.mesh == {'data': 4, 'fsdp': 1, 'tensor': 1}
  # Data parallel: every chip holds the whole state, float32 parameters and two Adam moments.
  s = state_lib.setup(
      config, vocab_size=compile_tool.vocab_size(config), bos_id=1, devices=jax.devices()[:1]
  )
  num_params = sum(x.size for x in jax.tree.leaves(s.abstract_state['params']))
  assert report.memory['argument_size_in_bytes'] >= 3 * 4 * num_params
  assert 0 < report.hbm_bytes < chips.CHIPS['v5e'].hbm_bytes
  # XLA counts every FLOP of the program (softmax, norms, the optimizer), the analytic count
  # only the matmuls: within a factor of 2.
  ratio = report.xla_flops * report.num_chips / report.analytic_flops
  assert 0.5 < ratio < 2.0, ratio
  # XLA's estimate, or the roofline where libtpu's cost model answers a negative time (mlm).
  assert 0 < report.step_secs < 1.0
  assert 0 < report.mfu < 1 and report.tokens_per_sec > 0


@needs_libtpu
@pytest.mark.slow
def test_a_step_that_does_not_fit_names_its_biggest_buffers():
  config = tiny('lm')
  # bfloat16 activations [rows x 128 tokens, 512] of the MLP: 4 GiB each per chip (splash keeps
  # the attention weights [rows, heads, 128, 128] out of the program).
  config.per_device_batch_size = 32768
  with pytest.raises(compile_tool.DoesNotFit) as error:
    compile_tool.compile_train_step(config, 'v5e:2x2', name='lm:tiny')
  message = str(error.value)
  print(message)
  first, *rest = message.splitlines()
  assert re.fullmatch(
      r'lm:tiny on v5e:2x2: the train step needs [\d.]+ GiB per chip; a v5e '
      r'chip has 16.00 GiB of HBM. Biggest buffers:',
      first,
  ), first
  assert float(first.split('needs ')[1].split()[0]) > 16
  # The MLP's hidden activations of the global batch (4 chips x 32768 rows x 128 tokens,
  # mlp_dim 512), named with their source lines.
  assert re.match(r'  16,384.0 MiB bf16\[(16777216,512|131072,128,512)\] ', rest[1]), message
  assert re.search(r'\((\w|\.)+, .+\.py:\d+\)$', rest[1]), message
  assert '4,128,128]' not in message  # no attention weights: splash
