r"""Translate raw text with a trained translation run's checkpoint.

    python -m lowrank_attn.translate --workdir=runs/multi30k [--input=FILE|-] [--output=FILE|-]
        [--beam_size=N] [--batch_size=N] [--step=N] [--average_last=N] [--length_penalty=A]
        [--max_length=N] [--reference=FILE]

One sentence per line in (raw text; `.gz` files are read as gzip), one translation per line
out, in the same order. The run's `config.json` gives the model, its tokenizer is read from the
run directory and only the parameters are restored from `checkpoints/<step>` (the latest
unless --step), onto a mesh of all local devices shaped as the run's (or all data-parallel if
that shape does not fit). The run directory may be remote (`--workdir=gs://BUCKET/run`: read
through `lowrank_attn.files` and Orbax). Sentences are encoded as training's evaluation encodes sources,
sorted by length, batched, searched by `lowrank_attn.train.decode`'s jitted beam search (the
one the end of training evaluates with), and put back in input order.

Behaviour: an empty line gives an empty line; a line longer than the model's sources
(`data.max_length` tokens with EOS) is cut to that length, with a warning naming the line.
`--reference=FILE` prints sacreBLEU's BLEU (cased, 13a tokenization of the detokenized text,
with its signature) and chrF against FILE. Everything but the translations goes to stderr:
a progress bar, the speed (sentences/s) and the share of the time spent outside the jitted
search. Bad input ends with one line on stderr and exit status 2, before anything is
translated: a missing run directory, one without checkpoints, an unknown --step, a config.json
that is not a translation run's training config, an --output that is a directory or cannot be
written.

Compiled searches are cached in --compilation_cache (default ~/.cache/lowrank_attn/jax), so a
second call on the same run with the same settings does not compile again.
"""

import dataclasses
import gzip
import os
import sys
import tempfile
import time
from typing import Any

from absl import app, flags, logging

from lowrank_attn import files, runs  # standard library only: a wrong --workdir fails at once

USAGE_ERROR = 2
# Over-long lines are named one by one up to this many, then counted.
MAX_NAMED_LINES = 20


class UsageError(Exception):
  """A problem with the command's arguments or the run directory: one line, exit status 2."""


def fail(message: str):
  sys.stderr.write(f'translate: {message}\n')
  sys.exit(USAGE_ERROR)


# ------------------------------------------------------------------------------ library
# What the command does, for scripts too (experiments.multi30k.final_scores); importing this
# module defines no flags.


def check_run(workdir: str, step: int | None) -> int:
  """The checkpoint step to restore, or UsageError (without importing JAX: fails fast)."""
  run = runs.RunDir(workdir)  # local or remote (gs://...: read through `lowrank_attn.files`)
  if not files.isdir(run.path):
    raise UsageError(f'--workdir={workdir}: no such directory.')
  if not run.is_run():
    raise UsageError(f'--workdir={workdir} is not a training run: it has no {runs.CONFIG_FILE}.')
  steps = run.steps()
  if not steps:
    raise UsageError(
        f'--workdir={workdir} has no checkpoint in {run.checkpoint_dir} (a run '
        'saves one every checkpoint_every_steps and at its end).'
    )
  if step is None:
    return steps[-1]
  if step not in steps:
    raise UsageError(
        f'--step={step}: {workdir} has no checkpoint of that step; it has '
        f'{", ".join(map(str, steps))}.'
    )
  return step


def read_lines(path: str, what: str) -> list[str]:
  """Lines of a text file (- = stdin; .gz = gzip), without line ends; a final newline does
  not start another line."""
  try:
    if path == '-':
      data = sys.stdin.buffer.read()
    else:
      opener = gzip.open if path.endswith('.gz') else open
      with opener(os.path.expanduser(path), 'rb') as f:
        data = f.read()
    text = data.decode('utf-8')
  except FileNotFoundError:
    raise UsageError(f'{what} {path}: no such file.') from None
  except (OSError, UnicodeDecodeError) as e:
    raise UsageError(f'{what} {path} is not readable UTF-8 text: {e}') from None
  if not text:
    return []
  return [line.removesuffix('\r') for line in text.removesuffix('\n').split('\n')]


def check_output(path: str) -> None:
  """UsageError unless a file can be written at `path` (checked before translating anything)."""
  full = os.path.abspath(os.path.expanduser(path))
  directory = os.path.dirname(full)
  if os.path.isdir(full):
    raise UsageError(f'--output={path} is a directory; name a file (in it, say).')
  if not os.path.isdir(directory):
    raise UsageError(f'--output={path}: no directory {directory}.')
  try:  # written, not asked (os.access): root passes permission checks, not a read-only disk
    fd, probe = tempfile.mkstemp(prefix='.write_test_', dir=directory)
    os.close(fd)
    os.unlink(probe)
  except OSError as e:
    raise UsageError(f'--output={path}: cannot write in {directory}: {e.strerror}.') from None


def run_config(workdir: str):
  """The run's config (`RunDir.config`: its config.json over the defaults of its task),
  validated; UsageError unless it is a valid translation run."""
  from lowrank_attn.train import config as config_lib

  try:
    config = runs.RunDir(workdir).config
    # A task that decodes owns the `decode` settings (`lowrank_attn.tasks.nmt`).
    decodes = 'decode' in config
    if decodes:
      config_lib.validate(config)
  except ValueError as e:
    raise UsageError(f'{workdir}/{runs.CONFIG_FILE}: {e}') from None
  if not decodes:
    raise UsageError(
        f'--workdir={workdir} is a {config.task!r} run; translate needs a run of a '
        'task that decodes (nmt).'
    )
  return config


@dataclasses.dataclass
class TranslationRun:
  """A translation run set up on this machine's devices: what `Translator`s are made of."""

  run: runs.RunDir
  config: Any  # the run's validated config, its mesh fitted to these devices
  tokenizer: Any
  setup: Any  # `lowrank_attn.train.state.Setup`

  @property
  def abstract_params(self):
    """Shapes and shardings of the parameters: what `run.restore_params` lays out as."""
    return self.setup.abstract_state['params']

  def translator(
      self,
      params,
      *,
      beam_size: int | None = None,
      length_penalty: float | None = None,
      max_length: int | None = None,
      batch_size: int | None = None,
  ):
    """A `decode.Translator` of `params`; settings default to the run's `decode` ones, the
    batch size to the one the end of training evaluates with."""
    from lowrank_attn.train import decode

    config = self.config
    return decode.Translator(
        self.setup,
        params,
        self.tokenizer,
        beam_size=beam_size or config.decode.beam_size,
        length_penalty=(config.decode.length_penalty if length_penalty is None else length_penalty),
        max_length=max_length or config.decode.max_length,
        batch_size=batch_size or decode.default_batch_size(self.setup),
        source_max_length=config.data.max_length,
    )


def open_run(workdir: str, config=None) -> TranslationRun:
  """Translation run `workdir` (its config: `run_config`, or `config`) set up on all local
  devices, shaped as the run's mesh, or all data-parallel if that shape does not fit.

  Raises UsageError for what the command reports in one line (exit status 2).
  """
  import jax

  from lowrank_attn import sharding

  run = runs.RunDir(workdir)
  config = run_config(workdir) if config is None else config
  try:
    tokenizer = run.tokenizer
  except FileNotFoundError as e:
    raise UsageError(f'--workdir={workdir}: {e}') from None
  try:
    sharding.mesh_shape(config.mesh.to_dict(), jax.device_count())
  except ValueError as e:  # the run's mesh does not fit these devices: all data-parallel
    say(
        f"translate: the run's mesh does not fit here ({e}); using the "
        f'{jax.device_count()} devices data-parallel.'
    )
    config.mesh.update({'data': -1, 'fsdp': 1, 'tensor': 1})
  return TranslationRun(run, config, tokenizer, run.setup(config))


class ProgressBar:
  """`[#####.....] 320/1014 sentences  41.2/s` on stderr: redrawn in place on a terminal,
  a line every `every_secs` otherwise."""

  def __init__(self, total: int, every_secs: float = 10.0):
    self.total, self.every_secs = total, every_secs
    self.interactive = sys.stderr.isatty()
    self.start = self.last = time.perf_counter()

  def __call__(self, done: int, total: int) -> None:
    now = time.perf_counter()
    if not self.interactive and now - self.last < self.every_secs and done < total:
      return
    self.last = now
    width = 30
    filled = int(width * done / max(total, 1))
    rate = done / max(now - self.start, 1e-9)
    line = f'[{"#" * filled}{"." * (width - filled)}] {done}/{total} sentences  {rate:.1f}/s'
    sys.stderr.write(f'\r\033[K{line}' if self.interactive else line + '\n')
    if self.interactive and done >= total:
      sys.stderr.write('\n')
    sys.stderr.flush()


def say(line: str) -> None:
  sys.stderr.write(line + '\n')
  sys.stderr.flush()


def translate_file(
    workdir: str,
    *,
    input_path: str = '-',
    output_path: str = '-',
    beam_size: int | None = None,
    batch_size: int | None = None,
    step: int | None = None,
    max_length: int | None = None,
    reference: str | None = None,
    average_last: int = 1,
    length_penalty: float | None = None,
    compilation_cache: str | None = None,
) -> dict:
  """What the command does; returns {'step', 'sentences', 'timing', 'bleu', 'chrf', ...}.

  Raises UsageError for what the command reports in one line (exit status 2).
  """
  started = time.perf_counter()
  workdir = runs.RunDir(workdir).path  # absolute; a remote (gs://) one as given
  step = check_run(workdir, step)
  sources = read_lines(input_path, '--input')
  references = read_lines(reference, '--reference') if reference is not None else None
  if references is not None and len(references) != len(sources):
    raise UsageError(
        f'--reference={reference} has {len(references)} lines but --input has '
        f'{len(sources)}; line i of one must translate line i of the other.'
    )
  for name, value in (
      ('beam_size', beam_size),
      ('batch_size', batch_size),
      ('max_length', max_length),
      ('average_last', average_last),
  ):
    if value is not None and value < 1:
      raise UsageError(f'--{name}={value} must be >= 1.')
  if output_path != '-':
    check_output(output_path)
    output_path = os.path.abspath(os.path.expanduser(output_path))

  import jax

  if compilation_cache:
    jax.config.update('jax_compilation_cache_dir', os.path.expanduser(compilation_cache))
  from lowrank_attn.train import decode

  config = run_config(workdir)
  beam_size = beam_size or config.decode.beam_size
  max_length = max_length or config.decode.max_length
  model_max = config.model.max_length
  if config.model.positions == 'learned' and max_length > model_max:
    raise UsageError(
        f'--max_length={max_length}: the model has learned positions up to '
        f'model.max_length={model_max}.'
    )
  opened = open_run(workdir, config)
  steps = opened.run.last_steps(average_last, up_to=step)
  if len(steps) < average_last:
    raise UsageError(
        f'--average_last={average_last}: {workdir} holds only {len(steps)} '
        f'checkpoints up to step {step} ({steps}).'
    )
  params = opened.run.averaged_params(steps, opened.abstract_params)  # checkpoint averaging
  translator = opened.translator(
      params,
      beam_size=beam_size,
      length_penalty=length_penalty,
      max_length=max_length,
      batch_size=batch_size,
  )
  averaged = f' (mean of steps {steps})' if len(steps) > 1 else ''
  mesh = dict(opened.setup.mesh.shape)
  say(
      f'translate: {workdir} step {step}{averaged}, {len(sources)} sentences, beam {beam_size}, '
      f'batch {translator.batch_size}, mesh {mesh} on {jax.device_count()} '
      f'{jax.devices()[0].platform} device(s); ready after {time.perf_counter() - started:.1f} s'
  )

  result = translator.translate(sources, progress=ProgressBar(len(sources)))
  for n, i in enumerate(result.truncated):
    if n == MAX_NAMED_LINES:
      say(f'translate: warning: and {len(result.truncated) - n} more over-long lines.')
      break
    say(
        f'translate: warning: line {i + 1} is longer than the {config.data.max_length} tokens '
        f'(with EOS) the model takes; translated its first {config.data.max_length - 1} tokens.'
    )
  text = ''.join(t + '\n' for t in result.texts)
  if output_path == '-':
    sys.stdout.write(text)
    sys.stdout.flush()
  else:
    try:
      with open(output_path, 'w', encoding='utf-8') as f:
        f.write(text)
    except OSError as e:
      raise UsageError(f'--output={output_path}: {e}') from None
  timing = translator.timing
  say(f'translate: {timing.describe()}')
  out = {
      'step': step,
      'sentences': len(sources),
      'beam_size': beam_size,
      'batch_size': translator.batch_size,
      'truncated': result.truncated,
      'translations': result.texts,
      'timing': timing,
      'sentences_per_sec': len(sources) / timing.total_secs if timing.total_secs else 0.0,
      'outside_search_share': timing.outside_share,
  }
  if references is not None:
    scores = decode.score(result.texts, references)
    say(f'BLEU {scores["bleu"]:.6f}  {scores["bleu_signature"]}\n  {scores["bleu_summary"]}')
    say(f'chrF2 {scores["chrf"]:.6f}  {scores["chrf_signature"]}')
    out.update(scores)
  return out


# ------------------------------------------------------------------------------ command line


def define_flags() -> None:
  """The command's flags (defined when run as a program only: importing defines none)."""
  flags.DEFINE_string(
      'workdir',
      None,
      'The training run: its directory (config.json, checkpoints/, tokenizers/), local or '
      'remote (gs://BUCKET/...).',
  )
  flags.DEFINE_string(
      'input', '-', 'Source sentences, one per line (.gz read as gzip); ' '- = stdin.'
  )
  flags.DEFINE_string('output', '-', 'Where the translations go, one per line; - = stdout.')
  flags.DEFINE_integer(
      'beam_size', None, "Beam size (1 = greedy); default: the run's " 'decode.beam_size.'
  )
  flags.DEFINE_integer(
      'batch_size',
      None,
      'Sentences per search call (rounded up to fill '
      "every device); default: the run's per_device_batch_size x devices, as "
      'the end of training evaluates.',
  )
  flags.DEFINE_integer('step', None, 'Checkpoint step; default: the latest.')
  flags.DEFINE_integer(
      'average_last',
      1,
      'Translate with the mean parameters of the last N '
      'checkpoints up to --step (checkpoint averaging); 1: that one only.',
  )
  flags.DEFINE_float(
      'length_penalty',
      None,
      'alpha of the beam score log p / ((5 + len) / '
      "6)^alpha; default: the run's decode.length_penalty.",
  )
  flags.DEFINE_integer(
      'max_length', None, 'Longest translation, in tokens; default: the ' "run's decode.max_length."
  )
  flags.DEFINE_string(
      'reference',
      None,
      'Reference translations, one per line (.gz allowed): ' 'print BLEU and chrF.',
  )
  flags.DEFINE_string(
      'compilation_cache',
      os.path.join('~', '.cache', 'lowrank_attn', 'jax'),
      'JAX persistent compilation cache directory; empty: none.',
  )
  flags.mark_flag_as_required('workdir')


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f'Unexpected arguments: {argv[1:]}')
  FLAGS = flags.FLAGS  # pylint: disable=invalid-name
  if not FLAGS['verbosity'].present:  # library INFO logs (Orbax) would drown the progress
    logging.set_verbosity(logging.WARNING)
  try:
    translate_file(
        FLAGS.workdir,
        input_path=FLAGS.input,
        output_path=FLAGS.output,
        beam_size=FLAGS.beam_size,
        batch_size=FLAGS.batch_size,
        step=FLAGS.step,
        max_length=FLAGS.max_length,
        reference=FLAGS.reference,
        average_last=FLAGS.average_last,
        length_penalty=FLAGS.length_penalty,
        compilation_cache=FLAGS.compilation_cache,
    )
  except UsageError as e:
    fail(str(e))


if __name__ == '__main__':
  define_flags()
  app.run(main)
