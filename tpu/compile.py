r"""Ahead-of-time compile of the real train step for a Cloud TPU slice, on any machine.

    python tpu/compile.py --config=configs/nmt.py --topology=v5e:4x4
    python tpu/compile.py --config=configs/lm.py --topology=v4:2x2x1 \
        --config.per_device_batch_size=256 --dump_hlo=/tmp/lm_hlo
    python tpu/compile.py --table --out=tpu/compile_table.md   # the table in tpu/README.md

Needs libtpu (`pip install -e '.[tpu]'`, or `make test-tpu`'s virtualenv), no TPU: the
devices of the slice come from `jax.experimental.topologies.get_topology_desc` and compile
only. The step is the one `train_and_evaluate` runs: `train.state.setup` (mesh from
`config.mesh` over those devices, logical rules, abstract state from `jax.eval_shape`) and
`train.state.lower_steps` (jit with the state's and batch's shardings, donated state), with
the batch that the training pipeline would give (its keys, `per_device_batch_size` x chips x
`grad_accum_steps` rows of `data.max_length`), and no data read.

Printed per chip: XLA's argument / output / temporary memory against the chip's HBM
(`lowrank_attn/chips.py`); the step's FLOPs from XLA's cost analysis against the analytic count the
training loop divides by (`Setup.step_flops`); XLA's estimated step time
(`optimal_seconds` of the cost analysis); the MFU and tokens/s that time implies. A program
that does not fit stops with `DoesNotFit`, naming its biggest buffers.

Topologies are libtpu's names, chip:shape: v4:2x2x1 (gcloud v4-8), v5e:4x4 (v5litepod-16),
v5p:2x2x4 (v5p-32), v6e:2x4 (v6e-8).
"""

import copy
import dataclasses
from importlib import metadata
import os
import re
import sys
import time

# Compile-only TPU devices need no TPU backend; off a TPU VM there is no metadata server; and
# with no TPU to guard, several compiles may load libtpu at once.
os.environ.setdefault('JAX_PLATFORMS', 'cpu')
os.environ.setdefault('TPU_SKIP_MDS_QUERY', '1')
os.environ.setdefault('ALLOW_MULTIPLE_LIBTPU_LOAD', '1')

from absl import app, flags, logging
import jax
from jax.experimental import topologies
from ml_collections import config_flags
import numpy as np

from lowrank_attn import chips
from lowrank_attn import data
from lowrank_attn import tasks
from lowrank_attn.data import tokenizers
from lowrank_attn.train import config as config_lib, state as state_lib

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# libtpu spells v5p 'v5'; the others as we do.
LIBTPU_CHIP_NAMES = {'v4': 'v4', 'v5e': 'v5e', 'v5p': 'v5', 'v6e': 'v6e'}
# A character vocabulary is learnt from the data; this bounds it (tiny Shakespeare: 70).
CHAR_VOCAB_SIZE = 256
TABLE_CONFIGS = ('configs/lm.py', 'configs/mlm.py', 'configs/nmt.py')
TABLE_TOPOLOGIES = ('v5e:4x4', 'v4:2x2x1', 'v5p:2x2x4')
GIB = 2**30


class DoesNotFit(Exception):
  """The step needs more HBM per chip than the chip has."""


class NoLibtpu(RuntimeError):
  """libtpu, which describes TPU slices and compiles for them, is not installed."""


# ------------------------------------------------------------------------------ devices


def topology_devices(topology: str) -> tuple[list, chips.Chip]:
  """The compile-only devices of a slice named 'v5e:4x4' (chip:shape), and its chip."""
  match = re.fullmatch(r'(v\d+[a-z]*):(\d+(?:x\d+){1,2})', topology.strip())
  if not match or match.group(1) not in LIBTPU_CHIP_NAMES:
    raise ValueError(f'--topology={topology!r} is not chip:shape with chip one of '
                     f"{tuple(LIBTPU_CHIP_NAMES)} (e.g. 'v4:2x2x1', 'v5e:4x4', 'v5p:2x2x4', "
                     "'v6e:2x4').")
  chip = chips.CHIPS[match.group(1)]
  shape = tuple(int(n) for n in match.group(2).split('x'))
  num_chips = int(np.prod(shape))
  # Hosts as on Cloud TPU: a small slice is one VM, a bigger one has 2x2 chips per VM.
  per_host = (shape + (1,) * (3 - len(shape)) if num_chips <= chip.max_single_host_chips
              else (2, 2, 1))
  try:
    description = topologies.get_topology_desc(
        platform='tpu', topology_name=f'{LIBTPU_CHIP_NAMES[chip.name]}:{match.group(2)}',
        chip_config_name='megacore' if chip.cores_per_chip == 2 else 'default',
        chips_per_host_bounds=per_host, num_slices=1)
  except RuntimeError as e:  # 'JAX TPU support not installed' without libtpu
    raise NoLibtpu(f'cannot describe TPU topology {topology!r}: {e}. AOT compilation '
                       "needs libtpu: pip install -e '.[tpu]' (or `make test-tpu`).") from e
  devices = list(description.devices)
  found = chips.chip_of(devices[0].device_kind)
  if found is not chip:
    raise ValueError(f'--topology={topology!r}: libtpu describes {devices[0].device_kind!r} '
                     f'devices, not {chip.name}.')
  return devices, chip


def accelerator_type(chip: chips.Chip, num_chips: int) -> str:
  """gcloud's name of the slice: 'v4-8' for 4 v4 chips, 'v5litepod-16' for 16 v5e chips."""
  return f'{chip.accelerator_prefix}-{num_chips * chip.cores_per_chip}'


# ------------------------------------------------------------------------------ inputs


def vocab_size(config) -> int:
  """The vocabulary the model is built with, without data: SentencePiece's is configured, a
  WordPiece one is read from its vocab file, a character one is bounded (CHAR_VOCAB_SIZE)."""
  if config.data.tokenizer == 'sentencepiece':
    return config.data.vocab_size
  if config.data.tokenizer == 'wordpiece':
    return tokenizers.load_or_train(
        'wordpiece', cache_path=None, training_texts=None, vocab_size=config.data.vocab_size,
        model_type=config.data.sentencepiece_model_type,
        vocab_path=config.data.vocab_path).vocab_size
  return CHAR_VOCAB_SIZE


def batch_spec(config, num_devices: int) -> dict:
  """The training pipeline's `element_spec` (one process, the whole slice's rows), no data."""
  rows = config.per_device_batch_size * num_devices * config.grad_accum_steps
  data_config = data.as_data_config(config.data)
  return tasks.get(config.task).data_format.element_spec(data_config, batch_size=rows,
                                                         train=True)


# ------------------------------------------------------------------------------ report


@dataclasses.dataclass
class Report:
  """What one compile says about a config on a slice. Memory and XLA FLOPs are per chip."""

  name: str  # the config, e.g. 'configs/nmt.py'
  topology: str
  chip: chips.Chip
  num_chips: int
  mesh: dict[str, int]
  memory: dict[str, int]  # CompiledMemoryStats fields, bytes per chip
  xla_flops: float  # per chip and step, XLA's cost analysis
  analytic_flops: float  # whole slice, per step: what the training loop's MFU divides
  xla_seconds: float | None  # XLA's estimated step time (cost analysis 'optimal_seconds')
  xla_bytes: float  # per chip and step: HBM bytes accessed, XLA's cost analysis
  tokens_per_step: int  # token positions of the inputs, as the training loop counts them
  compile_secs: float

  @property
  def hbm_bytes(self) -> int:
    """Per chip, as XLA allocates it: arguments + outputs (less the donated state they
    alias) + temporaries + the program."""
    m = self.memory
    return (m['argument_size_in_bytes'] + m['output_size_in_bytes'] - m['alias_size_in_bytes']
            + m['temp_size_in_bytes'] + m['generated_code_size_in_bytes'])

  @property
  def fits(self) -> bool:
    return self.hbm_bytes <= self.chip.hbm_bytes

  @property
  def step_secs(self) -> float:
    """XLA's estimate, else the roofline of XLA's FLOPs and bytes (a lower bound)."""
    if self.xla_seconds is not None:
      return self.xla_seconds
    return max(self.xla_flops / self.chip.peak_bf16_flops,
               self.xla_bytes / self.chip.hbm_bytes_per_sec)

  @property
  def step_secs_source(self) -> str:
    if self.xla_seconds is not None:
      return "XLA's estimate: cost analysis optimal_seconds"
    return ('XLA gave no estimate; roofline max(FLOPs / peak, bytes accessed / HBM bandwidth), '
            'a lower bound')

  @property
  def mfu(self) -> float:
    return self.analytic_flops / (self.step_secs * self.num_chips * self.chip.peak_bf16_flops)

  @property
  def tokens_per_sec(self) -> float:
    return self.tokens_per_step / self.step_secs

  def describe(self) -> str:
    m, hbm = self.memory, self.chip.hbm_bytes
    xla_total = self.xla_flops * self.num_chips
    return '\n'.join([
        f'{self.name} on {self.topology} ({accelerator_type(self.chip, self.num_chips)}, '
        f'{self.num_chips} {self.chip.name} chips), mesh {self.mesh}; compiled in '
        f'{self.compile_secs:.0f} s',
        f'memory per chip: arguments {_gib(m["argument_size_in_bytes"])}, outputs '
        f'{_gib(m["output_size_in_bytes"])} (aliasing {_gib(m["alias_size_in_bytes"])} of the '
        f'donated state), temporaries {_gib(m["temp_size_in_bytes"])}, program '
        f'{_gib(m["generated_code_size_in_bytes"])}',
        f'  total {_gib(self.hbm_bytes)} of {_gib(hbm)} HBM ({100 * self.hbm_bytes / hbm:.0f}%): '
        + ('fits' if self.fits else 'DOES NOT FIT'),
        f'FLOPs per step: XLA {xla_total / 1e12:.3f} TFLOP ({self.xla_flops / 1e12:.3f} per '
        f'chip), analytic {self.analytic_flops / 1e12:.3f} TFLOP (3x forward matmuls; XLA / '
        f'analytic = {xla_total / self.analytic_flops:.2f})',
        f'step time {1e3 * self.step_secs:.2f} ms ({self.step_secs_source})',
        f'  MFU {100 * self.mfu:.1f}% (analytic FLOPs / step time / {self.num_chips} x '
        f'{self.chip.peak_bf16_flops / 1e12:.0f} TFLOP/s, {self.chip.source}); '
        f'{self.tokens_per_sec:,.0f} tokens/s ({self.tokens_per_step:,} per step)',
    ])


def _gib(num_bytes: float) -> str:
  return f'{num_bytes / GIB:.2f} GiB'


def does_not_fit_message(name: str, topology: str, chip: chips.Chip, needed: int | None,
                         largest: list[str]) -> str:
  """The DoesNotFit error: what was needed against what the chip has, and the biggest
  buffers (`largest_buffers`, `largest_values` or the `memory_analysis` categories)."""
  need = f'needs {_gib(needed)} per chip' if needed is not None else 'does not fit'
  lines = [f'{name} on {topology}: the train step {need}; a {chip.name} chip has '
           f'{_gib(chip.hbm_bytes)} of HBM. Biggest buffers:']
  lines += [f'  {line}' for line in largest]
  lines.append('Lower per_device_batch_size (or raise grad_accum_steps), shard the parameters '
               '(--config.mesh.fsdp=N) or pick a slice with more chips or HBM.')
  return '\n'.join(lines)


def largest_buffers(xla_message: str, count: int = 5) -> list[str]:
  """The biggest allocations XLA's out-of-memory error lists ('Size: 1.2G ... Shape: ...')."""
  lines, taken = xla_message.splitlines(), []
  for i, line in enumerate(lines):
    if re.match(r'\s*\d+\.\s+Size:', line):
      detail = [lines[j].strip() for j in range(i + 1, min(i + 6, len(lines)))
                if re.match(r'\s*(Operator|Shape|Allocation type|XLA label):', lines[j])]
      taken.append(' '.join([line.strip(), *detail]))
    if len(taken) == count:
      break
  return taken


_DTYPE_BYTES = {'f64': 8, 'i64': 8, 'ui64': 8, 'f32': 4, 'i32': 4, 'ui32': 4, 'bf16': 2,
                'f16': 2, 'i16': 2, 'i8': 1, 'ui8': 1, 'i1': 1}


def largest_values(stablehlo: str, count: int = 5) -> list[str]:
  """The biggest arrays the step computes, from its lowered StableHLO (with debug info): size,
  global shape (before partitioning over the mesh), JAX operation and source line.

  For when XLA's out-of-memory error lists no allocations (libtpu 0.0.42 says only "the total
  memory required for HLO temporaries (44.48G) exceeds available HBM (15.75G)").
  """
  locations = dict(re.findall(r'^(#loc\d*) = loc\((.*)\)$', stablehlo, re.MULTILINE))

  def source(loc: str, depth: int = 0) -> str:
    text = locations.get(loc, '')
    inner = re.match(r'callsite\((#loc\d*) at', text)
    if inner and depth < 50:  # the innermost frame of a call stack
      return source(inner.group(1), depth + 1)
    frame = re.match(r'"([^"]+)"\((#loc\d*)\)$', text)  # function name (its file location)
    if frame and depth < 50:
      where = source(frame.group(2), depth + 1)
      return f'{frame.group(1)}, {where}' if where else ''
    file_line = re.match(r'"([^"]+)":(\d+)', text)
    if not file_line:
      return ''
    return f'{os.path.relpath(file_line.group(1), REPO_ROOT)}:{file_line.group(2)}'

  values = {}
  for dims, dtype, loc in re.findall(
      r'^\s*%[^=]+= .*[:>] tensor<((?:\d+x)*)(\w+)> loc\((#loc\d*)\)$', stablehlo,
      re.MULTILINE):
    if dtype not in _DTYPE_BYTES:
      continue
    shape = tuple(int(n) for n in dims.split('x') if n)
    name = re.match(r'"([^"]*)"(?:\((#loc\d*)\))?', locations.get(loc, ''))
    op, where = (name.group(1), source(name.group(2))) if name else ('', '')
    op = op.removeprefix('jit(train_step)/')
    key = (dtype, shape, op, where)
    values[key] = int(np.prod(shape)) * _DTYPE_BYTES[dtype]
  largest = sorted(values.items(), key=lambda kv: -kv[1])[:count]
  return [f'{size / 2**20:,.1f} MiB {dtype}[{",".join(map(str, shape))}] {op}'
          + (f' ({where})' if where else '')
          for (dtype, shape, op, where), size in largest]


def _needed_bytes(xla_message: str) -> int | None:
  """The HBM an out-of-memory error says the program needs: 'Used 21.09G of 15.75G hbm' or
  'the total memory required for HLO temporaries (44.48G) exceeds available HBM'."""
  match = re.search(r'Used ([\d.]+)([KMGT]) of|HLO temporaries \(([\d.]+)([KMGT])\)',
                    xla_message)
  if not match:
    return None
  number, unit = (match.group(1), match.group(2)) if match.group(1) else match.group(3, 4)
  return int(float(number) * 1024 ** ('KMGT'.index(unit) + 1))


# ------------------------------------------------------------------------------ compile


def compile_train_step(config, topology: str, *, name: str = 'config',
                       vocab: int | None = None, dump_hlo: str | None = None) -> Report:
  """AOT-compiles `config`'s train step for `topology`; raises DoesNotFit when it won't fit."""
  config_lib.validate(config)
  # 'cudnn'/'splash' are checked against the TPU compiled for, not this host's backend.
  config = copy.deepcopy(config)
  config.model.attention.platform = 'tpu'
  devices, chip = topology_devices(topology)
  s = state_lib.setup(config, vocab_size=vocab or vocab_size(config),
                      bos_id=tokenizers.BOS_ID, devices=devices)
  spec = batch_spec(config, len(devices))
  start = time.perf_counter()
  lowered, _ = state_lib.lower_steps(s, spec)
  try:
    compiled = lowered.compile()
  except Exception as e:  # XlaRuntimeError; its type is not public API
    message = str(e)
    if 'RESOURCE_EXHAUSTED' not in message and 'out of memory' not in message.lower():
      raise
    largest = largest_buffers(message) or [
        'XLA named none; the biggest arrays of the program, global shapes:',
        *largest_values(lowered.as_text(debug_info=True))]
    raise DoesNotFit(does_not_fit_message(name, topology, chip, _needed_bytes(message),
                                          largest)) from None
  compile_secs = time.perf_counter() - start
  if dump_hlo:
    os.makedirs(dump_hlo, exist_ok=True)
    path = os.path.join(dump_hlo, 'train_step.hlo.txt')
    with open(path, 'w') as f:
      f.write(compiled.as_text())
    print(f'compiled HLO written to {path}')
  stats = compiled.memory_analysis()
  memory = {field: getattr(stats, field) for field in (
      'argument_size_in_bytes', 'output_size_in_bytes', 'alias_size_in_bytes',
      'temp_size_in_bytes', 'generated_code_size_in_bytes')}
  cost = compiled.cost_analysis()
  cost = cost[0] if isinstance(cost, list) else cost  # older jax: one dict per program
  shapes = state_lib.element_shapes(spec)
  report = Report(
      name=name, topology=topology, chip=chip, num_chips=len(devices),
      mesh=dict(s.mesh.shape), memory=memory, xla_flops=float(cost['flops']),
      analytic_flops=float(s.step_flops(shapes)),
      # libtpu's cost model sometimes answers a negative time: no estimate.
      xla_seconds=cost['optimal_seconds'] if cost.get('optimal_seconds', 0) > 0 else None,
      xla_bytes=float(cost['bytes accessed']),
      tokens_per_step=int(np.prod(shapes['inputs'][:2])), compile_secs=compile_secs)
  if not report.fits:  # XLA's own limit may differ from the published HBM
    raise DoesNotFit(does_not_fit_message(name, topology, chip, report.hbm_bytes,
                                          _largest_from_memory(memory)))
  return report


def _largest_from_memory(memory: dict[str, int]) -> list[str]:
  """The memory_analysis categories, biggest first (when XLA itself did not complain)."""
  return [f'{field.removesuffix("_size_in_bytes")}: {_gib(size)}'
          for field, size in sorted(memory.items(), key=lambda kv: -kv[1])]


# ------------------------------------------------------------------------------ table


TABLE_HEADER = ('| config | slice (topology) | mesh | fits? | HBM / chip | est. step time | '
                'MFU | tokens/s | XLA / analytic FLOPs |\n|---|---|---|---|---|---|---|---|---|')


def table_row(name: str, topology: str, outcome: Report | DoesNotFit) -> str:
  if isinstance(outcome, DoesNotFit):
    first = str(outcome).splitlines()[0]
    needed = re.search(r'needs ([\d.]+ GiB)', first)
    return (f'| {name} | {topology} | | no | {needed.group(1) if needed else "?"} needed | '
            '| | | |')
  r = outcome
  ratio = r.xla_flops * r.num_chips / r.analytic_flops
  return (f'| {name} | {accelerator_type(r.chip, r.num_chips)} ({topology}) | '
          f'{"x".join(str(n) for n in r.mesh.values())} | yes | {_gib(r.hbm_bytes)} of '
          f'{r.chip.hbm_bytes // GIB} | {1e3 * r.step_secs:.1f} ms'
          f'{"" if r.xla_seconds else " *"} | {100 * r.mfu:.0f}% | {r.tokens_per_sec:,.0f} | '
          f'{ratio:.2f} |')


def write_table(config_names, topology_names, out: str | None) -> str:
  """Compiles every config on every topology; the markdown table, rewritten to `out` after
  every compile (so that an interrupted table keeps its rows)."""
  head = [f'Written by `python tpu/compile.py --table` (jax {jax.__version__}, libtpu '
          f'{_libtpu_version()}), per chip. Step time: XLA\'s estimate (* where it gave none: '
          'the roofline of its FLOPs and bytes, a lower bound); MFU = analytic FLOPs / step '
          'time / published bf16 peak (`lowrank_attn/chips.py`).', '', TABLE_HEADER]
  rows = []
  for topology in topology_names:
    for name in config_names:
      config = config_lib.load(os.path.join(REPO_ROOT, name))
      try:
        outcome = compile_train_step(config, topology, name=name)
        print(outcome.describe(), flush=True)
      except DoesNotFit as e:
        outcome = e
        print(e, flush=True)
      rows.append(table_row(name, topology, outcome))
      text = '\n'.join([*head, *rows, ''])
      if out:
        with open(out, 'w') as f:
          f.write(text)
  return text


def _libtpu_version() -> str:
  try:
    return metadata.version('libtpu')
  except metadata.PackageNotFoundError:
    return 'unknown'


# ------------------------------------------------------------------------------ main


FLAGS = flags.FLAGS


def define_flags():
  """The command line's flags (defined when run as a script: tests import this module)."""
  flags.DEFINE_string('topology', None,
                      "libtpu topology chip:shape, e.g. 'v5e:4x4' (v5litepod-16).")
  flags.DEFINE_integer('vocab_size', None,
                       'Vocabulary size; default: from the config (see `vocab_size`).')
  flags.DEFINE_string('dump_hlo', None, 'Directory to write the compiled HLO of the train step.')
  flags.DEFINE_bool('table', False, 'Compile every --table_configs on every '
                    '--table_topologies and print (or --out) a markdown table.')
  flags.DEFINE_list('table_configs', list(TABLE_CONFIGS), 'Config files for --table.')
  flags.DEFINE_list('table_topologies', list(TABLE_TOPOLOGIES), 'Topologies for --table.')
  flags.DEFINE_string('out', None, 'With --table: write the table to this file.')
  config_flags.DEFINE_config_file('config', None, 'Task config file, e.g. configs/nmt.py.',
                                  lock_config=True)


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f'Unexpected arguments: {argv[1:]}')
  if not FLAGS['verbosity'].present:
    logging.set_verbosity(logging.WARNING)
  if FLAGS.table:
    print(write_table(FLAGS.table_configs, FLAGS.table_topologies, FLAGS.out))
    return
  if FLAGS.config is None or FLAGS.topology is None:
    raise app.UsageError('--config and --topology are required (or --table).')
  try:
    report = compile_train_step(FLAGS.config, FLAGS.topology,
                                name=config_flags.get_config_filename(FLAGS['config']),
                                vocab=FLAGS.vocab_size, dump_hlo=FLAGS.dump_hlo)
  except (DoesNotFit, NoLibtpu, ValueError) as e:
    sys.exit(str(e))
  print(report.describe())


if __name__ == '__main__':
  define_flags()
  app.run(main)
