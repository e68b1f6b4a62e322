r"""Ahead-of-time compile of the real train step for a Cloud TPU slice, on any machine.

    python tpu/compile.py --config=configs/nmt.py --topology=v5e:4x4
    python tpu/compile.py --config=configs/lm.py --topology=v4:2x2x1 \
        --config.per_device_batch_size=256 --dump_hlo=/tmp/lm_hlo
    python tpu/compile.py --table --out=tpu/compile_table.md \
        --cache_dir=/tmp/compile_cache                          # the table in tpu/README.md

Needs libtpu (`pip install -e '.[tpu]'`, or `make test-tpu`'s virtualenv), no TPU: the
devices of the slice come from `jax.experimental.topologies.get_topology_desc` and compile
only. The step is the one `train_and_evaluate` runs: `train.state.setup` (mesh from
`config.mesh` over those devices, logical rules, abstract state from `jax.eval_shape`) and
`train.state.lower_steps` (jit with the state's and batch's shardings, donated state), with
the batch that the training pipeline would give (its keys, `per_device_batch_size` x chips x
`grad_accum_steps` rows of `data.max_length`), and no data read. dtype='auto' and
implementation='auto' resolve for the TPU compiled for (bfloat16; splash for rows of >= 128
tokens), and the report says what the compiled program holds: the dtypes its matrix products
take, the Mosaic (splash) kernels in it.

Printed per chip: XLA's argument / output / temporary memory against the chip's HBM
(`lowrank_attn/chips.py`); the step's FLOPs from XLA's cost analysis against the analytic
count the training loop divides by (`Setup.step_flops`); XLA's estimated step time
(`optimal_seconds` of the cost analysis) plus the splash kernels' FLOPs at peak (the cost
analysis counts no Mosaic kernel); the MFU and tokens/s that time implies; the arithmetic
intensity against the chip's ridge point, and where the HBM bytes go. A program that does not
fit stops with `DoesNotFit`, naming its biggest buffers.

`--table`: per config and topology, the per-chip batch (doublings of the config's, remat
'none' first, then `REMAT_CANDIDATES`) of the best predicted MFU that fits (`choose_batch`),
with its roofline bound and a note on what would lift it; then the paper-scale rows
(`PAPER_RUNS`) with their chip-hours.

Topologies are libtpu's names, chip:shape: v4:2x2x1 (gcloud v4-8), v5e:4x4 (v5litepod-16),
v5p:2x2x4 (v5p-32), v6e:2x4 (v6e-8).
"""

import copy
import dataclasses
import hashlib
from importlib import metadata
import json
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
from lowrank_attn.attention import dispatch
from lowrank_attn.data import tokenizers
from lowrank_attn.train import config as config_lib, state as state_lib

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# libtpu spells v5p 'v5'; the others as we do.
LIBTPU_CHIP_NAMES = {'v4': 'v4', 'v5e': 'v5e', 'v5p': 'v5', 'v6e': 'v6e'}
# A character vocabulary is learnt from the data; this bounds it (tiny Shakespeare: 70).
CHAR_VOCAB_SIZE = 256
TABLE_CONFIGS = ('configs/lm.py', 'configs/mlm.py', 'configs/nmt.py')
# The first is the goal's slice; the paper-scale rows come after its rows.
TABLE_TOPOLOGIES = ('v5p:2x2x4', 'v5e:4x4', 'v4:2x2x1')
# Predicted MFU the table aims at on v5p-32 (issue 23, item 6).
MFU_GOALS = {'configs/lm.py': 0.50, 'configs/mlm.py': 0.50, 'configs/nmt.py': 0.40}
GOAL_TOPOLOGY = 'v5p:2x2x4'  # where the goals are set; elsewhere a row only says its bound
DEFAULT_MFU_GOAL = 0.50
# Tried, in order, where remat 'none' stops fitting below the goal.
REMAT_CANDIDATES = ('dots_saveable', 'full')
# The batch search stops at this multiple of the config's per_device_batch_size.
MAX_BATCH_FACTOR = 32
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
    raise ValueError(
        f'--topology={topology!r} is not chip:shape with chip one of '
        f"{tuple(LIBTPU_CHIP_NAMES)} (e.g. 'v4:2x2x1', 'v5e:4x4', 'v5p:2x2x4', "
        "'v6e:2x4')."
    )
  chip = chips.CHIPS[match.group(1)]
  shape = tuple(int(n) for n in match.group(2).split('x'))
  num_chips = int(np.prod(shape))
  # Hosts as on Cloud TPU: a small slice is one VM, a bigger one has 2x2 chips per VM.
  per_host = (
      shape + (1,) * (3 - len(shape)) if num_chips <= chip.max_single_host_chips else (2, 2, 1)
  )
  try:
    description = topologies.get_topology_desc(
        platform='tpu',
        topology_name=f'{LIBTPU_CHIP_NAMES[chip.name]}:{match.group(2)}',
        chip_config_name='megacore' if chip.cores_per_chip == 2 else 'default',
        chips_per_host_bounds=per_host,
        num_slices=1,
    )
  except RuntimeError as e:  # 'JAX TPU support not installed' without libtpu
    raise NoLibtpu(
        f'cannot describe TPU topology {topology!r}: {e}. AOT compilation '
        "needs libtpu: pip install -e '.[tpu]' (or `make test-tpu`)."
    ) from e
  devices = list(description.devices)
  found = chips.chip_of(devices[0].device_kind)
  if found is not chip:
    raise ValueError(
        f'--topology={topology!r}: libtpu describes {devices[0].device_kind!r} '
        f'devices, not {chip.name}.'
    )
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
        'wordpiece',
        cache_path=None,
        training_texts=None,
        vocab_size=config.data.vocab_size,
        model_type=config.data.sentencepiece_model_type,
        vocab_path=config.data.vocab_path,
    ).vocab_size
  return CHAR_VOCAB_SIZE


def batch_spec(config, num_devices: int) -> dict:
  """The training pipeline's `element_spec` (one process, the whole slice's rows), no data."""
  rows = config.per_device_batch_size * num_devices * config.grad_accum_steps
  data_config = data.as_data_config(config.data)
  return tasks.get(config.task).data_format.element_spec(data_config, batch_size=rows, train=True)


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
  per_device_batch_size: int = 0  # rows per chip (x grad_accum_steps)
  remat: str = 'none'  # config.model.remat
  dtype: str = 'float32'  # the computation dtype, 'auto' resolved for TPU
  # In the compiled program: Mosaic kernels (custom-call names, e.g. splash_mha_fwd...) and
  # the operand dtypes of its matrix products ('bf16 x bf16': count).
  kernels: tuple[str, ...] = ()
  matmul_dtypes: dict[str, int] = dataclasses.field(default_factory=dict)
  # Per chip and step: the attention products of the layers 'auto' gives to splash (3x their
  # forward, as the analytic count credits them). XLA's cost analysis does not count a Mosaic
  # kernel (libtpu 0.0.42: FLOPs and time -1 for a splash call alone), so they are added back.
  kernel_flops: float = 0.0
  # Per chip and step: the compiled program's HBM bytes by kind (`hbm_bytes_by_kind`).
  bytes_by_kind: dict[str, float] = dataclasses.field(default_factory=dict)

  @property
  def hbm_bytes(self) -> int:
    """Per chip, as XLA allocates it: arguments + outputs (less the donated state they
    alias) + temporaries + the program."""
    m = self.memory
    return (
        m['argument_size_in_bytes']
        + m['output_size_in_bytes']
        - m['alias_size_in_bytes']
        + m['temp_size_in_bytes']
        + m['generated_code_size_in_bytes']
    )

  @property
  def fits(self) -> bool:
    return self.hbm_bytes <= self.chip.hbm_bytes

  @property
  def flops(self) -> float:
    """Per chip and step: XLA's count and the Mosaic kernels' it leaves out."""
    return self.xla_flops + self.kernel_flops

  @property
  def kernel_secs(self) -> float:
    """The Mosaic kernels' FLOPs at the chip's peak (XLA's estimate leaves them out)."""
    return self.kernel_flops / self.chip.peak_bf16_flops

  @property
  def step_secs(self) -> float:
    """XLA's estimate plus the kernels' FLOPs at peak, else the roofline (a lower bound)."""
    if self.xla_seconds is not None:
      return self.xla_seconds + self.kernel_secs
    return self.roofline_secs

  @property
  def step_secs_source(self) -> str:
    kernels = (
        f" + {1e3 * self.kernel_secs:.2f} ms of splash FLOPs at peak (not in XLA's "
        'cost analysis)'
        if self.kernel_flops
        else ''
    )
    if self.xla_seconds is not None:
      return (
          f"XLA's estimate: cost analysis optimal_seconds {1e3 * self.xla_seconds:.2f} ms" + kernels
      )
    return (
        'XLA gave no estimate; roofline max(FLOPs / peak, bytes accessed / HBM bandwidth), '
        'a lower bound'
    )

  @property
  def intensity(self) -> float:
    """Arithmetic intensity of the step: FLOPs (`flops`) per HBM byte XLA says it accesses."""
    return arithmetic_intensity(self.flops, self.xla_bytes)

  @property
  def bound(self) -> str:
    """'compute' or 'memory': the step's intensity against the chip's ridge point."""
    return roofline_bound(self.flops, self.xla_bytes, self.chip)

  @property
  def roofline_secs(self) -> float:
    """max(FLOPs / peak, bytes / HBM bandwidth): no step of this program can be faster."""
    return max(self.flops / self.chip.peak_bf16_flops, self.xla_bytes / self.chip.hbm_bytes_per_sec)

  @property
  def attention(self) -> str:
    """What computes attention in the compiled program: 'splash' where its Mosaic kernels
    are there (every layer, or only some, e.g. not the short rows), else 'xla'."""
    return 'splash' if any(k.startswith('splash') for k in self.kernels) else 'xla'

  @property
  def mfu(self) -> float:
    return self.analytic_flops / (self.step_secs * self.num_chips * self.chip.peak_bf16_flops)

  @property
  def tokens_per_sec(self) -> float:
    return self.tokens_per_step / self.step_secs

  @property
  def byte_shares(self) -> dict[str, float]:
    """`bytes_by_kind` as shares of their sum."""
    total = sum(self.bytes_by_kind.values()) or 1.0
    return {kind: value / total for kind, value in self.bytes_by_kind.items()}

  @property
  def flops_ratio(self) -> float:
    """The program's FLOPs (XLA's and the kernels') over the analytic count MFU credits."""
    return self.flops * self.num_chips / self.analytic_flops

  def describe(self) -> str:
    m, hbm = self.memory, self.chip.hbm_bytes
    kernels = f', + {self.kernel_flops / 1e12:.3f} in splash kernels' if self.kernel_flops else ''
    return '\n'.join(
        [
            f'{self.name} on {self.topology} ({accelerator_type(self.chip, self.num_chips)}, '
            f'{self.num_chips} {self.chip.name} chips), mesh {self.mesh}; compiled in '
            f'{self.compile_secs:.0f} s',
            f'memory per chip: arguments {_gib(m["argument_size_in_bytes"])}, outputs '
            f'{_gib(m["output_size_in_bytes"])} (aliasing {_gib(m["alias_size_in_bytes"])} of the '
            f'donated state), temporaries {_gib(m["temp_size_in_bytes"])}, program '
            f'{_gib(m["generated_code_size_in_bytes"])}',
            f'  total {_gib(self.hbm_bytes)} of {_gib(hbm)} HBM '
            f'({100 * self.hbm_bytes / hbm:.0f}%): ' + ('fits' if self.fits else 'DOES NOT FIT'),
            f'FLOPs per step: XLA {self.xla_flops * self.num_chips / 1e12:.3f} TFLOP '
            f'({self.xla_flops / 1e12:.3f} per chip{kernels}), analytic '
            f'{self.analytic_flops / 1e12:.3f} TFLOP (3x forward matmuls; program / analytic = '
            f'{self.flops_ratio:.2f})',
            f'step time {1e3 * self.step_secs:.2f} ms ({self.step_secs_source})',
            f'  MFU {100 * self.mfu:.1f}% (analytic FLOPs / step time / {self.num_chips} x '
            f'{self.chip.peak_bf16_flops / 1e12:.0f} TFLOP/s, {self.chip.source}); '
            f'{self.tokens_per_sec:,.0f} tokens/s ({self.tokens_per_step:,} per step)',
            f"  arithmetic intensity {self.intensity:.0f} FLOP/B (FLOPs / XLA's bytes accessed) "
            f'against the ridge point {ridge_point(self.chip):.0f} FLOP/B (peak / HBM bandwidth): '
            f'{self.bound}-bound; roofline {1e3 * self.roofline_secs:.2f} ms',
            *(
                [
                    f'  HBM bytes by kind (operands and results of the compiled operations, '
                    f"{_gib(sum(self.bytes_by_kind.values()))} against XLA's "
                    f'{_gib(self.xla_bytes)}): '
                    + ', '.join(
                        f'{kind} {100 * share:.0f}%' for kind, share in self.byte_shares.items()
                    )
                ]
                if self.bytes_by_kind
                else []
            ),
            f'per chip batch {self.per_device_batch_size} rows, compute {self.dtype}, remat '
            f'{self.remat}; matmul operands {_dtype_counts(self.matmul_dtypes)}; Mosaic kernels: '
            f'{", ".join(self.kernels) or "none"} (attention: {self.attention})',
        ]
    )

  def to_json(self) -> dict:
    return {**dataclasses.asdict(self), 'chip': self.chip.name, 'kernels': list(self.kernels)}

  @classmethod
  def from_json(cls, values: dict) -> 'Report':
    return cls(
        **{**values, 'chip': chips.CHIPS[values['chip']], 'kernels': tuple(values['kernels'])}
    )


def _dtype_counts(counts: dict[str, int]) -> str:
  return ', '.join(f'{n} {pair}' for pair, n in sorted(counts.items(), key=lambda kv: -kv[1]))


# ------------------------------------------------------------------------------ roofline


def ridge_point(chip: chips.Chip) -> float:
  """FLOP per HBM byte at which the chip's peak compute and HBM bandwidth take equal time:
  a program of lower intensity is memory-bound (v5p: 459e12 / 2765e9 = 166 FLOP/B)."""
  return chip.peak_bf16_flops / chip.hbm_bytes_per_sec


def arithmetic_intensity(flops: float, bytes_accessed: float) -> float:
  return flops / bytes_accessed if bytes_accessed > 0 else float('inf')


def roofline_bound(flops: float, bytes_accessed: float, chip: chips.Chip) -> str:
  """'compute' if `flops` over `bytes_accessed` reach the chip's ridge point, else 'memory'."""
  return (
      'compute' if arithmetic_intensity(flops, bytes_accessed) >= ridge_point(chip) else ('memory')
  )


def matmul_intensity_limit(rows: int, k: int, n: int, bytes_per_element: int = 2) -> float:
  """FLOP per byte of one [rows, k] x [k, n] product that reads both operands and writes its
  result once: 2 rows k n / (bytes x (rows k + k n + rows n)). As rows grow it tends to
  k n / (bytes (k + n)): a D x D projection in bfloat16 never exceeds D / 2 FLOP/B."""
  return 2 * rows * k * n / (bytes_per_element * (rows * k + k * n + rows * n))


# ------------------------------------------------------------------------------ program


def splash_flops(model_cfg, task: tasks.Task, rows: int, length: int) -> float:
  """Training FLOPs (3x forward) of the attention products q.k and w.v in the layers that
  'auto' gives to splash on TPU, for `rows` rows of `length` tokens (every attention type of
  our tasks has `length` queries and keys), full [length, length] as the analytic count
  takes them."""
  total = 0
  for attention_type in task.attention_types:
    for layer in range(model_cfg.num_layers(attention_type)):
      spec = model_cfg.attention(attention_type, layer)
      if spec.implementation == 'auto':
        # As the layer calls it in training: segment ids (no boolean mask), no cache.
        implementation = dispatch.choose_implementation(
            spec,
            q_length=length,
            kv_length=length,
            batch=rows,
            dtype=model_cfg.compute_dtype,
            platform='tpu',
            dropout=spec.dropout_rate > 0,
        )
      else:
        implementation = spec.implementation
      if implementation != 'splash' or spec.num_heads == 0:
        continue
      key_width = (
          spec.query_heads * spec.head_dim
          if spec.is_dot_product
          else (spec.num_heads * spec.key_dim)
      )
      pairs = rows * length * length
      total += 3 * 2 * pairs * (key_width + spec.num_heads * spec.head_dim)
  return float(total)


def mosaic_kernels(hlo: str) -> tuple[str, ...]:
  """The Mosaic (Pallas TPU) kernels of a compiled program: the names of its
  `tpu_custom_call`s without their numeric suffix, e.g. 'splash_mha_fwd_segmented_residuals'."""
  names = re.findall(
      r'^\s*(?:ROOT )?%([\w\-]+?)(?:\.\d+)* = ' r'.*custom_call_target="tpu_custom_call"',
      hlo,
      re.MULTILINE,
  )
  return tuple(sorted(set(names)))


_ELEMENT_BYTES = {
    'pred': 1,
    's8': 1,
    'u8': 1,
    'bf16': 2,
    'f16': 2,
    's16': 2,
    'u16': 2,
    'f32': 4,
    's32': 4,
    'u32': 4,
    'f64': 8,
    's64': 8,
    'u64': 8,
}
# Operations that move no data of their own (views, bookkeeping, the tuple plumbing).
_NO_BYTES = (
    'parameter',
    'get-tuple-element',
    'tuple',
    'bitcast',
    'constant',
    'after-all',
    'partition-id',
    'replica-id',
    'copy-start',
    'copy-done',
    'opt-barrier',
)
_COLLECTIVES = ('all-reduce', 'all-gather', 'reduce-scatter', 'all-to-all', 'collective-permute')
BYTE_KINDS = ('matmul', 'vocab', 'attention kernel', 'collective', 'elementwise')


def _array_bytes(type_text: str) -> int:
  """Bytes of the arrays a type spells ('bf16[32,128]{1,0}' or a tuple of them)."""
  total = 0
  for dtype, dims in re.findall(r'\b([a-z]+\d*)\[([\d,]*)\]', type_text):
    if dtype in _ELEMENT_BYTES:
      total += _ELEMENT_BYTES[dtype] * int(np.prod([int(d) for d in dims.split(',') if d]))
  return total


def hlo_computations(hlo: str) -> tuple[dict[str, list[str]], str | None]:
  """The computations of an HLO module's text, name -> instruction lines (a line that a
  string attribute broke, as Mosaic calls' backend_config does, joined again), and the entry's
  name."""
  computations, entry, current = {}, None, None
  for line in hlo.splitlines():
    header = re.match(r'(ENTRY )?(%[\w.\-]+) \(.*\{$', line)
    if header:
      current = computations.setdefault(header.group(2), [])
      entry = header.group(2) if header.group(1) else entry
    elif line == '}':
      current = None
    elif current is not None:
      if re.match(r'\s+(?:ROOT )?%', line) or not current:
        current.append(line)
      else:
        current[-1] += '\n' + line
  return computations, entry


def hbm_bytes_by_kind(hlo: str, vocab_size: int | None) -> dict[str, float]:
  """Where a compiled program's HBM traffic goes: bytes of the operands and results of the
  entry computation's operations (what XLA's 'bytes accessed' adds up), by kind.

  'vocab': an operation with a [.., vocab_size] array (the output layer's logits, their
  softmax and gradients); 'matmul': other fusions with a matrix product; 'attention kernel':
  Mosaic calls; 'collective': all-reduce and co; 'elementwise': the rest (norms, activations,
  dropout, the optimizer, layout copies).
  """
  computations, entry = hlo_computations(hlo)
  with_products = {
      name
      for name, lines in computations.items()
      if any(re.search(r' (?:convolution|dot)\(', line) for line in lines)
  }
  instruction = re.compile(r'\s*(?:ROOT )?(%[\w.\-]+) = (.*?) ([a-z][a-z\-]*)\((.*)', re.DOTALL)
  result_bytes, result_types, totals = {}, {}, dict.fromkeys(BYTE_KINDS, 0.0)
  for line in computations.get(entry, ()):
    m = instruction.match(line)
    if not m:
      continue
    name, type_text, op, rest = m.groups()
    result_types[name] = type_text
    result_bytes[name] = _array_bytes(type_text)
    if op in _NO_BYTES:
      continue
    operands = re.findall(r'(%[\w.\-]+)', rest.split('),', 1)[0])
    moved = result_bytes[name] + sum(result_bytes.get(o, 0) for o in operands)
    types = type_text + ' '.join(result_types.get(o, '') for o in operands)
    calls = re.search(r'calls=(%[\w.\-]+)', rest)
    if vocab_size and re.search(rf'[\[,]{vocab_size}[\],]', types):
      kind = 'vocab'
    elif op in ('convolution', 'dot') or (calls and calls.group(1) in with_products):
      kind = 'matmul'
    elif 'tpu_custom_call' in rest:
      kind = 'attention kernel'
    elif op.removesuffix('-start').removesuffix('-done') in _COLLECTIVES:
      kind = 'collective'
    else:
      kind = 'elementwise'
    totals[kind] += moved
  return totals


def matmul_operand_dtypes(hlo: str) -> dict[str, int]:
  """How many matrix products (TPU HLO `convolution`s and `dot`s) a compiled program has per
  operand dtypes, e.g. {'bf16 x bf16': 37, 'f32 x f32': 2}: what the MXU is really fed."""
  types = dict(re.findall(r'^\s*(?:ROOT )?(%[\w.\-]+) = \(?(\w+)\[', hlo, re.MULTILINE))
  counts: dict[str, int] = {}
  for lhs, rhs in re.findall(
      r'^\s*(?:ROOT )?%[\w.\-]+ = \w+\[[^=]*? (?:convolution|dot)\('
      r'(%[\w.\-]+), (%[\w.\-]+)[,)]',
      hlo,
      re.MULTILINE,
  ):
    pair = f'{types.get(lhs, "?")} x {types.get(rhs, "?")}'
    counts[pair] = counts.get(pair, 0) + 1
  return counts


def _gib(num_bytes: float) -> str:
  return f'{num_bytes / GIB:.2f} GiB'


def does_not_fit_message(
    name: str, topology: str, chip: chips.Chip, needed: int | None, largest: list[str]
) -> str:
  """The DoesNotFit error: what was needed against what the chip has, and the biggest
  buffers (`largest_buffers`, `largest_values` or the `memory_analysis` categories)."""
  need = f'needs {_gib(needed)} per chip' if needed is not None else 'does not fit'
  lines = [
      f'{name} on {topology}: the train step {need}; a {chip.name} chip has '
      f'{_gib(chip.hbm_bytes)} of HBM. Biggest buffers:'
  ]
  lines += [f'  {line}' for line in largest]
  lines.append(
      'Lower per_device_batch_size (or raise grad_accum_steps), shard the parameters '
      '(--config.mesh.fsdp=N) or pick a slice with more chips or HBM.'
  )
  return '\n'.join(lines)


def largest_buffers(xla_message: str, count: int = 5) -> list[str]:
  """The biggest allocations XLA's out-of-memory error lists ('Size: 1.2G ... Shape: ...')."""
  lines, taken = xla_message.splitlines(), []
  for i, line in enumerate(lines):
    if re.match(r'\s*\d+\.\s+Size:', line):
      detail = [
          lines[j].strip()
          for j in range(i + 1, min(i + 6, len(lines)))
          if re.match(r'\s*(Operator|Shape|Allocation type|XLA label):', lines[j])
      ]
      taken.append(' '.join([line.strip(), *detail]))
    if len(taken) == count:
      break
  return taken


_DTYPE_BYTES = {
    'f64': 8,
    'i64': 8,
    'ui64': 8,
    'f32': 4,
    'i32': 4,
    'ui32': 4,
    'bf16': 2,
    'f16': 2,
    'i16': 2,
    'i8': 1,
    'ui8': 1,
    'i1': 1,
}


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
      r'^\s*%[^=]+= .*[:>] tensor<((?:\d+x)*)(\w+)> loc\((#loc\d*)\)$', stablehlo, re.MULTILINE
  ):
    if dtype not in _DTYPE_BYTES:
      continue
    shape = tuple(int(n) for n in dims.split('x') if n)
    name = re.match(r'"([^"]*)"(?:\((#loc\d*)\))?', locations.get(loc, ''))
    op, where = (name.group(1), source(name.group(2))) if name else ('', '')
    op = op.removeprefix('jit(train_step)/')
    key = (dtype, shape, op, where)
    values[key] = int(np.prod(shape)) * _DTYPE_BYTES[dtype]
  largest = sorted(values.items(), key=lambda kv: -kv[1])[:count]
  return [
      f'{size / 2**20:,.1f} MiB {dtype}[{",".join(map(str, shape))}] {op}'
      + (f' ({where})' if where else '')
      for (dtype, shape, op, where), size in largest
  ]


def _needed_bytes(xla_message: str) -> int | None:
  """The HBM an out-of-memory error says the program needs: 'Used 21.09G of 15.75G hbm' or
  'the total memory required for HLO temporaries (44.48G) exceeds available HBM'."""
  match = re.search(r'Used ([\d.]+)([KMGT]) of|HLO temporaries \(([\d.]+)([KMGT])\)', xla_message)
  if not match:
    return None
  number, unit = (match.group(1), match.group(2)) if match.group(1) else match.group(3, 4)
  return int(float(number) * 1024 ** ('KMGT'.index(unit) + 1))


# ------------------------------------------------------------------------------ compile


def compile_train_step(
    config,
    topology: str,
    *,
    name: str = 'config',
    vocab: int | None = None,
    dump_hlo: str | None = None,
    cache_dir: str | None = None,
) -> Report:
  """AOT-compiles `config`'s train step for `topology`; raises DoesNotFit when it won't fit.

  cache_dir: where outcomes are kept, keyed by the lowered program and the topology (a
  changed model, config or jax lowers to another program, hence another key): the table's
  batch search compiles each candidate once across runs.
  """
  config_lib.validate(config)
  # 'cudnn'/'splash' are checked against, and 'auto' and dtype='auto' resolved for, the TPU
  # compiled for, not this host's backend.
  config = copy.deepcopy(config)
  config.model.attention.platform = 'tpu'
  devices, chip = topology_devices(topology)
  s = state_lib.setup(
      config, vocab_size=vocab or vocab_size(config), bos_id=tokenizers.BOS_ID, devices=devices
  )
  spec = batch_spec(config, len(devices))
  shapes = state_lib.element_shapes(spec)
  # What the setup says (recomputed on every call, cached outcome or not).
  known = dict(
      name=name,
      topology=topology,
      chip=chip,
      num_chips=len(devices),
      mesh=dict(s.mesh.shape),
      analytic_flops=float(s.step_flops(shapes)),
      tokens_per_step=int(np.prod(shapes['inputs'][:2])),
      per_device_batch_size=config.per_device_batch_size,
      remat=config.model.remat,
      dtype=s.model_cfg.resolved_dtype,
      kernel_flops=splash_flops(s.model_cfg, s.task, shapes['inputs'][0], shapes['inputs'][1])
      / len(devices),
  )
  lowered, _ = state_lib.lower_steps(s, spec)
  cache_path = None
  if cache_dir and not dump_hlo:
    key = hashlib.sha256(
        '\n'.join([lowered.as_text(), topology, jax.__version__, _libtpu_version()]).encode()
    ).hexdigest()
    cache_path = os.path.join(cache_dir, f'{key[:32]}.json')
    if os.path.exists(cache_path):
      with open(cache_path) as f:
        cached = json.load(f)
      if 'does_not_fit' in cached:
        raise DoesNotFit(cached['does_not_fit'].replace(cached['name'], name, 1))
      report = dataclasses.replace(Report.from_json(cached), **known)
      _check_kernels(report)
      return report
  start = time.perf_counter()
  try:
    compiled = _compile(lowered, name, topology, chip)
  except DoesNotFit as e:
    _store(cache_path, {'name': name, 'does_not_fit': str(e)})
    raise
  compile_secs = time.perf_counter() - start
  hlo = compiled.as_text()
  if dump_hlo:
    os.makedirs(dump_hlo, exist_ok=True)
    path = os.path.join(dump_hlo, 'train_step.hlo.txt')
    with open(path, 'w') as f:
      f.write(hlo)
    with open(os.path.join(dump_hlo, 'train_step.stablehlo.txt'), 'w') as f:
      f.write(lowered.as_text())
    print(f'compiled HLO written to {path}')
  stats = compiled.memory_analysis()
  memory = {
      field: getattr(stats, field)
      for field in (
          'argument_size_in_bytes',
          'output_size_in_bytes',
          'alias_size_in_bytes',
          'temp_size_in_bytes',
          'generated_code_size_in_bytes',
      )
  }
  cost = compiled.cost_analysis()
  cost = cost[0] if isinstance(cost, list) else cost  # older jax: one dict per program
  report = Report(
      **known,
      memory=memory,
      xla_flops=float(cost['flops']),
      # libtpu's cost model sometimes answers a negative time: no estimate.
      xla_seconds=cost['optimal_seconds'] if cost.get('optimal_seconds', 0) > 0 else None,
      xla_bytes=float(cost['bytes accessed']),
      compile_secs=compile_secs,
      kernels=mosaic_kernels(hlo),
      matmul_dtypes=matmul_operand_dtypes(hlo),
      bytes_by_kind=hbm_bytes_by_kind(hlo, _distinct_vocab(s.model_cfg, config)),
  )
  _check_kernels(report)
  if not report.fits:  # XLA's own limit may differ from the published HBM
    error = DoesNotFit(
        does_not_fit_message(name, topology, chip, report.hbm_bytes, _largest_from_memory(memory))
    )
    _store(cache_path, {'name': name, 'does_not_fit': str(error)})
    raise error
  _store(cache_path, report.to_json())
  return report


def _check_kernels(report: 'Report') -> None:
  """The splash FLOPs added back are those of a program that has splash's kernels."""
  if (report.attention == 'splash') != (report.kernel_flops > 0):
    raise RuntimeError(
        f'{report.name}: the compiled program has Mosaic kernels '
        f'{report.kernels or "none"}, but the attention layers that \'auto\' '
        f'gives splash count {report.kernel_flops:.3g} FLOPs per chip.'
    )


def _distinct_vocab(model_cfg, config) -> int | None:
  """The vocabulary size where no other dimension of the step shares it (configs/lm.py's 256
  characters are also its 256 positions): what `hbm_bytes_by_kind` can tell apart."""
  others = {
      config.data.max_length,
      model_cfg.max_length,
      model_cfg.emb_dim,
      model_cfg.mlp_dim,
      config.per_device_batch_size,
  }
  return None if model_cfg.vocab_size in others else model_cfg.vocab_size


def _compile(lowered, name: str, topology: str, chip: chips.Chip):
  try:
    return lowered.compile()
  except Exception as e:  # XlaRuntimeError; its type is not public API
    message = str(e)
    if 'RESOURCE_EXHAUSTED' not in message and 'out of memory' not in message.lower():
      raise
    largest = largest_buffers(message) or [
        'XLA named none; the biggest arrays of the program, global shapes:',
        *largest_values(lowered.as_text(debug_info=True)),
    ]
    raise DoesNotFit(
        does_not_fit_message(name, topology, chip, _needed_bytes(message), largest)
    ) from None


def _store(path: str | None, values: dict) -> None:
  if path:
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, 'w') as f:
      json.dump(values, f)


def _largest_from_memory(memory: dict[str, int]) -> list[str]:
  """The memory_analysis categories, biggest first (when XLA itself did not complain)."""
  return [
      f'{field.removesuffix("_size_in_bytes")}: {_gib(size)}'
      for field, size in sorted(memory.items(), key=lambda kv: -kv[1])
  ]


# ------------------------------------------------------------------------------ batch search


Outcome = Report | DoesNotFit


def batch_ladder(start: int, cap: int) -> list[int]:
  """The per-chip batches the search may try: `start` doubled and halved (while a whole
  number), up to `cap`; for a power-of-two start, the powers of two up to cap."""
  ladder, b = [], start
  while b % 2 == 0 and b // 2 >= 1:
    b //= 2
  while b <= cap:
    ladder.append(b)
    b *= 2
  return ladder


def search_batch(
    compile_at,
    *,
    start: int,
    cap: int,
    guess: float | None = None,
    outcomes: dict[int, Outcome] | None = None,
) -> tuple[int | None, dict[int, Outcome]]:
  """The largest batch of `batch_ladder(start, cap)` whose step fits: `compile_at(batch)`
  returns a Report or raises DoesNotFit (a batch fits when a larger one does).

  Starts at the ladder's batch nearest below `guess` (default `start`), doubles while the
  step fits or halves until it does: with a good guess, two compiles. Returns the batch (None
  if not even the smallest fits) and every outcome by batch (`outcomes` seeds it: batches
  compiled already are not compiled again).
  """
  outcomes = {} if outcomes is None else dict(outcomes)
  ladder = batch_ladder(start, cap)

  def fits(i: int) -> bool:
    batch = ladder[i]
    if batch not in outcomes:
      try:
        outcomes[batch] = compile_at(batch)
      except DoesNotFit as e:
        outcomes[batch] = e
    return not isinstance(outcomes[batch], DoesNotFit)

  target = start if guess is None else guess
  i = max([j for j, b in enumerate(ladder) if b <= target], default=0)
  if fits(i):
    while i + 1 < len(ladder) and fits(i + 1):
      i += 1
    return ladder[i], outcomes
  while i > 0:
    i -= 1
    if fits(i):
      return ladder[i], outcomes
  return None, outcomes


# The search's guess fills this share of HBM (the compile decides; this only saves compiles).
GUESS_HBM_FILL = 0.9


def predicted_batch(report: Report) -> float:
  """A guess of the rows per chip that fill HBM, from one compile: arguments, outputs and the
  program as they are; temporaries in proportion to the rows, less one float32 copy of the
  parameters (their gradients, a third of a data-parallel Adam state's arguments), which does
  not grow with the batch."""
  m = report.memory
  gradients = m['argument_size_in_bytes'] / 3
  per_row = max(m['temp_size_in_bytes'] - gradients, 1) / report.per_device_batch_size
  fixed = report.hbm_bytes - m['temp_size_in_bytes'] + gradients
  return (GUESS_HBM_FILL * report.chip.hbm_bytes - fixed) / per_row


@dataclasses.dataclass
class Trial:
  remat: str
  batch: int
  outcome: Outcome


def choose_batch(
    config,
    topology: str,
    *,
    name: str,
    goal: float,
    max_factor: int,
    remat_candidates=REMAT_CANDIDATES,
    compile_fn=None,
    **compile_kwargs,
):
  """The per-chip batch and remat policy of the best predicted MFU among those that fit.

  remat 'none' first: the config's batch, then (`search_batch`) the largest of its doublings
  up to `max_factor` x that fits. Where 'none' stops fitting below the cap and the MFU is
  under `goal`, each of `remat_candidates` at twice that batch, doubling while it fits and
  its MFU rises. Returns (the best Report, or the DoesNotFit of the config's batch when
  nothing fits; every Trial in the order compiled). `compile_fn` (default
  `compile_train_step`) is called as compile_fn(config, topology, name=..., **compile_kwargs).
  """
  compile_fn = compile_fn or compile_train_step
  trials: list[Trial] = []

  def compile_at(remat: str, batch: int) -> Report:
    c = copy.deepcopy(config)
    c.per_device_batch_size = batch
    c.model.remat = remat
    try:
      report = compile_fn(c, topology, name=name, **compile_kwargs)
    except DoesNotFit as e:
      trials.append(Trial(remat, batch, e))
      print(f'{name} on {topology}, {batch} rows per chip, remat {remat}: does not fit', flush=True)
      raise
    trials.append(Trial(remat, batch, report))
    print(report.describe(), flush=True)
    return report

  start = config.per_device_batch_size
  cap = start * max_factor
  try:
    guess = predicted_batch(compile_at('none', start))
  except DoesNotFit:
    guess = start / 2
  none_batch, _ = search_batch(
      lambda b: compile_at('none', b),
      start=start,
      cap=cap,
      guess=guess,
      outcomes={t.batch: t.outcome for t in trials},
  )
  best = _best(trials)
  if none_batch is not None and none_batch < cap and best.mfu < goal:
    for remat in remat_candidates:
      batch, last = 2 * none_batch, best.mfu
      while batch <= cap:
        try:
          report = compile_at(remat, batch)
        except DoesNotFit:
          break
        if report.mfu <= last:
          break
        batch, last = 2 * batch, report.mfu
  best = _best(trials)
  return (best if best is not None else trials[0].outcome), trials


def _best(trials: list[Trial]) -> Report | None:
  reports = [t.outcome for t in trials if isinstance(t.outcome, Report)]
  return max(reports, key=lambda r: r.mfu, default=None)


# ------------------------------------------------------------------------------ bounds


# What would shrink each kind of HBM traffic (`hbm_bytes_by_kind`).
BYTE_LIFTS = {
    'vocab': (
        "the output layer's [outputs, {vocab:,}] logits, their softmax and gradient: a "
        'cross-entropy fused with the output product, never writing them to HBM'
    ),
    'elementwise': (
        'norms, activations, dropout masks, residuals, the optimizer: fewer passes '
        'over the activations (fusion)'
    ),
    'attention kernel': "splash's operands and float32 statistics",
    'collective': 'the gradient all-reduce: fsdp, or more rows per step',
    'matmul': 'the matrix products: a wider model',
}
SIGNIFICANT_SHARE = 0.15  # byte kinds above this share are named in the note


def lift_note(
    report: Report,
    trials: list[Trial],
    goal: float,
    *,
    emb_dim: int,
    vocab: int,
    length: int,
    head_dim: int,
) -> str:
  """Why the predicted MFU stays under `goal` and what would lift it, from the numbers: the
  roofline bound and the MFU it allows, how the intensity moved with the batch, where the
  bytes go, the FLOPs MFU does not count, and how far XLA's estimate sits above the
  roofline."""
  if report.mfu >= goal:
    return 'goal met'
  ridge = ridge_point(report.chip)
  same = sorted(
      (t.outcome for t in trials if t.remat == report.remat and isinstance(t.outcome, Report)),
      key=lambda r: r.per_device_batch_size,
  )
  smallest = same[0] if same else report
  ratio = report.flops_ratio
  notes = []
  if report.bound == 'memory':
    # MFU = analytic / (step x peak) <= (analytic / FLOPs) x intensity / ridge.
    notes.append(
        f'memory-bound: {report.intensity:.0f} < {ridge:.0f} FLOP/B caps MFU at '
        f'{100 * report.intensity / ridge / ratio:.0f}%'
    )
    if smallest is not report and report.intensity > 1.1 * smallest.intensity:
      notes.append(
          f'intensity grew {smallest.intensity:.0f} -> {report.intensity:.0f} from '
          f'{smallest.per_device_batch_size} to {report.per_device_batch_size} rows '
          'per chip (the fixed per-step bytes amortise)'
      )
    elif smallest is not report:
      notes.append(
          f'{smallest.per_device_batch_size} -> {report.per_device_batch_size} rows '
          f'moved it only {smallest.intensity:.0f} -> {report.intensity:.0f}: the bytes '
          'are per token, a larger batch does not help'
      )
  else:
    notes.append(f'compute-bound ({report.intensity:.0f} >= {ridge:.0f} FLOP/B)')
  if emb_dim / 2 < 1.5 * ridge:
    notes.append(
        f'D={emb_dim}: a bf16 D x D product reaches at most {emb_dim // 2} FLOP/B, '
        f'under 1.5x the ridge: a wider model (D >= {_width_for(ridge)})'
    )
  if report.attention == 'xla':
    # q.k of one head and row: [length, head_dim] x [head_dim, length] in bfloat16.
    notes.append(
        f"attention through 'xla' on rows of {length} tokens: a head's q.k product "
        f'reaches {matmul_intensity_limit(length, head_dim, length):.0f} FLOP/B '
        f'(rows of >= {dispatch.FUSED_MIN_LENGTH} tokens, packed, would go to splash)'
    )
  shares = report.byte_shares
  for kind, share in sorted(shares.items(), key=lambda kv: -kv[1]):
    if kind != 'matmul' and share >= SIGNIFICANT_SHARE:
      notes.append(
          f'{kind} ops move {100 * share:.0f}% of the bytes ('
          + BYTE_LIFTS[kind].format(vocab=vocab)
          + ')'
      )
  if ratio > 1.05:
    recompute = ', recomputation' if report.remat != 'none' else ''
    notes.append(
        f'{100 * (1 - 1 / ratio):.0f}% of the FLOPs are not model matmuls (softmax, '
        f'norms, optimizer{recompute}): MFU does not count them'
    )
  excess = report.step_secs / report.roofline_secs
  if report.xla_seconds is not None and excess > 1.1:
    notes.append(
        f"XLA's estimate is {excess:.2f}x the step's roofline: its memory-bound "
        'operations take time that the average intensity hides'
    )
  return '; '.join(notes)


def _width_for(ridge: float) -> int:
  """The smallest power-of-two D whose bf16 D x D products reach `ridge` FLOP/B (D / 2)."""
  width = 128
  while width / 2 < 1.5 * ridge:  # half again above the ridge: elementwise bytes come along
    width *= 2
  return width


def chip_hours(steps: int, step_secs: float, num_chips: int) -> float:
  """A run's chip-hours: steps x step time x chips / 3600."""
  return steps * step_secs * num_chips / 3600


# ------------------------------------------------------------------------------ table


@dataclasses.dataclass(frozen=True)
class PaperRun:
  """One paper-scale row: a config variant, overrides, the slice and the steps it is priced
  for. Rows of the same `schedule` add up to one run's chip-hours."""

  label: str
  config: str  # 'configs/nmt.py:transformer_big'
  topology: str
  steps: int
  schedule: str
  overrides: tuple[tuple[str, object], ...] = ()


PAPER_RUNS = (
    PaperRun(
        'Transformer-big, WMT14 En-De (Vaswani et al. 2017): 24,576 tokens per side',
        'configs/nmt.py:transformer_big',
        'v5p:2x2x4',
        300_000,
        'Transformer-big, 300k steps',
    ),
    PaperRun(
        'BERT-large phase 1 (Devlin et al. 2019): 256 x 128 tokens, 90% of the steps',
        'configs/mlm.py:bert_large',
        'v5p:2x2x4',
        900_000,
        "BERT-large, BERT's schedule (900k steps at L=128, 100k at L=512)",
        (('data.max_length', 128),),
    ),
    PaperRun(
        'BERT-large phase 2: 256 x 512 tokens, the last 10%',
        'configs/mlm.py:bert_large',
        'v5p:2x2x4',
        100_000,
        "BERT-large, BERT's schedule (900k steps at L=128, 100k at L=512)",
    ),
    PaperRun(
        'BERT-large, all 1M steps at 256 x 512 tokens',
        'configs/mlm.py:bert_large',
        'v5p:2x2x4',
        1_000_000,
        'BERT-large, 1M steps at L=512',
    ),
)

MAIN_HEADER = (
    '| config | slice (topology) | mesh | batch / chip | remat | attention | fits? | '
    'HBM / chip | step time | MFU (v5p-32 goal) | tokens/s | program / analytic FLOPs | '
    'FLOP/B (ridge) | bound | what would lift it | batches tried: MFU |\n'
    '|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|'
)
PAPER_HEADER = (
    '| run | config | slice (topology) | batch (global) | fits? | HBM / chip | step time | MFU | '
    'attention | bound | steps | chip-hours |\n|---|---|---|---|---|---|---|---|---|---|---|---|'
)


def _step_time(r: Report) -> str:
  return f'{1e3 * r.step_secs:.1f} ms{"" if r.xla_seconds else " *"}'


def _tried(trials: list[Trial]) -> str:
  parts = []
  for t in sorted(trials, key=lambda t: (t.remat != 'none', t.remat, t.batch)):
    what = 'no fit' if isinstance(t.outcome, DoesNotFit) else f'{100 * t.outcome.mfu:.0f}%'
    parts.append(f'{t.batch}{"" if t.remat == "none" else " " + t.remat}: {what}')
  return ', '.join(parts)


def _needed(outcome: DoesNotFit) -> str:
  needed = re.search(r'needs ([\d.]+ GiB)', str(outcome).splitlines()[0])
  return f'{needed.group(1)} needed' if needed else 'over HBM'


def main_row(
    name: str, topology: str, outcome: Outcome, trials: list[Trial], goal: float, **model
) -> str:
  """A row of the main table; `model`: lift_note's emb_dim, vocab and task."""
  if isinstance(outcome, DoesNotFit):
    return (
        f'| {name} | {topology} | | | | | no | {_needed(outcome)} | | | | | | | '
        f'| {_tried(trials)} |'
    )
  r = outcome
  # The goals are v5p-32's; on other slices the note says the bound whatever the MFU.
  goal_text, note_goal = (
      (f' ({100 * goal:.0f}%)', goal) if topology == GOAL_TOPOLOGY else ('', float('inf'))
  )
  return (
      f'| {name} | {accelerator_type(r.chip, r.num_chips)} ({topology}) | '
      f'{"x".join(str(n) for n in r.mesh.values())} | {r.per_device_batch_size} | '
      f'{r.remat} | {r.attention} | yes | {_gib(r.hbm_bytes)} of {r.chip.hbm_bytes // GIB} | '
      f'{_step_time(r)} | {100 * r.mfu:.0f}%{goal_text} | {r.tokens_per_sec:,.0f} | '
      f'{r.flops_ratio:.2f} | {r.intensity:.0f} ({ridge_point(r.chip):.0f}) | {r.bound} | '
      f'{lift_note(r, trials, note_goal, **model)} | {_tried(trials)} |'
  )


def paper_row(run: PaperRun, outcome: Outcome) -> str:
  name = run.config + ''.join(f' {k}={v}' for k, v in run.overrides)
  if isinstance(outcome, DoesNotFit):
    return (
        f'| {run.label} | {name} | {run.topology} | | no | {_needed(outcome)} | | | | | '
        f'{run.steps:,} | |'
    )
  r = outcome
  rows = r.per_device_batch_size * r.num_chips
  length = r.tokens_per_step // rows
  return (
      f'| {run.label} | {name} | {accelerator_type(r.chip, r.num_chips)} ({run.topology}) | '
      f'{rows} x {length} | yes | {_gib(r.hbm_bytes)} of {r.chip.hbm_bytes // GIB} | '
      f'{_step_time(r)} | {100 * r.mfu:.0f}% | {r.attention} | {r.bound} | {run.steps:,} | '
      f'{chip_hours(run.steps, r.step_secs, r.num_chips):,.0f} |'
  )


def schedule_totals(runs, outcomes) -> list[str]:
  """One line per schedule of PAPER_RUNS whose rows all fit: the chip-hours they add up to."""
  lines, schedules = [], dict.fromkeys(run.schedule for run in runs)
  for schedule in schedules:
    parts = [(run, outcomes.get(run)) for run in runs if run.schedule == schedule]
    if any(not isinstance(o, Report) for _, o in parts):
      continue
    hours = sum(chip_hours(run.steps, o.step_secs, o.num_chips) for run, o in parts)
    num_chips = max(o.num_chips for _, o in parts)
    wall = hours / num_chips
    wall_text = f'{wall:.1f} hours' if wall < 48 else f'{wall / 24:.1f} days'
    lines.append(f'- {schedule}: {hours:,.0f} chip-hours ({wall_text} on {num_chips} chips)')
  return lines


def table_text(
    main_rows: list[str], paper_rows: list[str], totals: list[str], max_factor: int
) -> str:
  return '\n'.join(
      [
          f'Written by `python tpu/compile.py --table` (jax {jax.__version__}, libtpu '
          f"{_libtpu_version()}): XLA's cost model for the compiled train step, per chip, not "
          'measurements on a TPU. Computation dtype and attention as the configs leave them '
          "(dtype='auto': bfloat16 on TPU, float32 parameters; implementation='auto': splash "
          'where the rows have >= 128 tokens); the attention column says what the compiled '
          'program contains (splash: its Mosaic kernels are there).',
          '',
          f"Batch per chip: the config's, then its doublings (up to {max_factor}x) while the step "
          'fits, remat none first; where none stops fitting under the goal, dots_saveable and full '
          'at larger batches; the row is the best MFU tried (all in the last column). Step time: '
          "XLA's estimate (cost analysis optimal_seconds; * where it gave none: the roofline "
          'max(FLOPs / peak, bytes / HBM bandwidth), a lower bound) plus, for splash, its q.k and '
          'w.v FLOPs at peak: the cost analysis counts no Mosaic kernel. MFU = analytic FLOPs (3x '
          'forward matmuls) / step time / published bf16 peak (`lowrank_attn/chips.py`). FLOP/B: '
          "those FLOPs (XLA's and splash's) over XLA's bytes accessed, against the ridge point "
          'peak / HBM bandwidth; below it the step is memory-bound. The shares of bytes in the '
          "notes add up the operands and results of the compiled program's operations by kind. "
          'The batch that fills HBM is a cost-model optimum, not a recommended training batch.',
          '',
          MAIN_HEADER,
          *main_rows,
          '',
          '### Paper-scale runs',
          '',
          "Fixed batches (the papers'), no search; chip-hours = steps x step time x chips / 3600 "
          'at the estimated step time (evaluation, checkpoints and input not included).',
          '',
          PAPER_HEADER,
          *paper_rows,
          '',
          *totals,
          '',
      ]
  )


def write_table(
    config_names,
    topology_names,
    out: str | None,
    *,
    paper_runs=PAPER_RUNS,
    max_factor: int = MAX_BATCH_FACTOR,
    cache_dir: str | None = None,
) -> str:
  """The batch search for every config on every topology and the paper-scale rows, in the
  order: configs on the first topology, paper rows, the other topologies. The markdown is
  rewritten to `out` after every row (an interrupted table keeps the rows it has)."""
  main_rows, paper_rows, outcomes, text = [], [], {}, ''

  def flush():
    nonlocal text
    text = table_text(main_rows, paper_rows, schedule_totals(paper_runs, outcomes), max_factor)
    if out:
      with open(out, 'w') as f:
        f.write(text)

  def main_rows_for(topology):
    for name in config_names:
      config = config_lib.load(os.path.join(REPO_ROOT, name))
      goal = MFU_GOALS.get(name, DEFAULT_MFU_GOAL)
      best, trials = choose_batch(
          config, topology, name=name, goal=goal, max_factor=max_factor, cache_dir=cache_dir
      )
      main_rows.append(
          main_row(
              name,
              topology,
              best,
              trials,
              goal,
              emb_dim=config.model.emb_dim,
              vocab=vocab_size(config),
              length=config.data.max_length,
              head_dim=config.model.emb_dim // config.model.attention.num_heads,
          )
      )
      flush()

  main_rows_for(topology_names[0])
  for run in paper_runs:
    config = config_lib.load(os.path.join(REPO_ROOT, run.config))
    for field, value in run.overrides:
      *groups, leaf = field.split('.')
      node = config
      for group in groups:
        node = node[group]
      node[leaf] = value
    try:
      outcome = compile_train_step(config, run.topology, name=run.config, cache_dir=cache_dir)
      print(outcome.describe(), flush=True)
    except DoesNotFit as e:
      outcome = e
      print(e, flush=True)
    outcomes[run] = outcome
    paper_rows.append(paper_row(run, outcome))
    flush()
  for topology in topology_names[1:]:
    main_rows_for(topology)
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
  flags.DEFINE_string(
      'topology', None, "libtpu topology chip:shape, e.g. 'v5e:4x4' (v5litepod-16)."
  )
  flags.DEFINE_integer(
      'vocab_size', None, 'Vocabulary size; default: from the config (see `vocab_size`).'
  )
  flags.DEFINE_string('dump_hlo', None, 'Directory to write the compiled HLO of the train step.')
  flags.DEFINE_bool(
      'table',
      False,
      'Compile every --table_configs on every '
      '--table_topologies and print (or --out) a markdown table.',
  )
  flags.DEFINE_list('table_configs', list(TABLE_CONFIGS), 'Config files for --table.')
  flags.DEFINE_list('table_topologies', list(TABLE_TOPOLOGIES), 'Topologies for --table.')
  flags.DEFINE_string('out', None, 'With --table: write the table to this file.')
  flags.DEFINE_bool('table_paper', True, 'With --table: add the paper-scale rows (PAPER_RUNS).')
  flags.DEFINE_integer(
      'max_batch_factor',
      MAX_BATCH_FACTOR,
      "With --table: the batch search's cap, a multiple of the config's " 'per_device_batch_size.',
  )
  flags.DEFINE_string(
      'cache_dir',
      None,
      'Keep compile outcomes here, keyed by the lowered program and topology: '
      'a table run again (interrupted, or with other notes) compiles only '
      'what changed. Default: no cache.',
  )
  config_flags.DEFINE_config_file(
      'config', None, 'Task config file, e.g. configs/nmt.py.', lock_config=True
  )


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f'Unexpected arguments: {argv[1:]}')
  if not FLAGS['verbosity'].present:
    logging.set_verbosity(logging.WARNING)
  if FLAGS.table:
    print(
        write_table(
            FLAGS.table_configs,
            FLAGS.table_topologies,
            FLAGS.out,
            paper_runs=PAPER_RUNS if FLAGS.table_paper else (),
            max_factor=FLAGS.max_batch_factor,
            cache_dir=FLAGS.cache_dir,
        )
    )
    return
  if FLAGS.config is None or FLAGS.topology is None:
    raise app.UsageError('--config and --topology are required (or --table).')
  try:
    report = compile_train_step(
        FLAGS.config,
        FLAGS.topology,
        name=config_flags.get_config_filename(FLAGS['config']),
        vocab=FLAGS.vocab_size,
        dump_hlo=FLAGS.dump_hlo,
        cache_dir=FLAGS.cache_dir,
    )
  except (DoesNotFit, NoLibtpu, ValueError) as e:
    sys.exit(str(e))
  print(report.describe())


if __name__ == '__main__':
  define_flags()
  app.run(main)
