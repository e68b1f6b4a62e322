"""tpu/compile.py --table: the batch search, the roofline bound, chip-hours and the program
checks, with fake compiles (no libtpu); and the paper-scale config variants it prices."""

import dataclasses
import pathlib

import pytest

from lowrank_attn import chips
from lowrank_attn import tasks
from lowrank_attn.train import config as config_lib
from tpu import compile as compile_tool

ROOT = pathlib.Path(__file__).resolve().parents[2]
V5P = chips.CHIPS['v5p']
GIB = 2**30


def report(
    batch=64,
    remat='none',
    mfu=0.3,
    *,
    xla_flops=1e12,
    xla_bytes=5e9,
    xla_seconds=0.01,
    num_chips=16,
    chip=V5P,
    temp=GIB,
):
  """A Report whose MFU is `mfu` (analytic FLOPs set to match the step time)."""
  analytic = mfu * xla_seconds * num_chips * chip.peak_bf16_flops
  memory = {
      'argument_size_in_bytes': 3 * GIB,
      'output_size_in_bytes': 3 * GIB,
      'alias_size_in_bytes': 3 * GIB,
      'temp_size_in_bytes': temp,
      'generated_code_size_in_bytes': 0,
  }
  return compile_tool.Report(
      name='x',
      topology='v5p:2x2x4',
      chip=chip,
      num_chips=num_chips,
      mesh={'data': num_chips, 'fsdp': 1, 'tensor': 1},
      memory=memory,
      xla_flops=xla_flops,
      analytic_flops=analytic,
      xla_seconds=xla_seconds,
      xla_bytes=xla_bytes,
      tokens_per_step=batch * num_chips * 128,
      compile_secs=1.0,
      per_device_batch_size=batch,
      remat=remat,
  )


def fake_compile(limit, calls):
  """compile_at(batch): fits up to `limit` rows, records every call."""

  def compile_at(batch):
    calls.append(batch)
    if batch > limit:
      raise compile_tool.DoesNotFit(f'x needs {batch} rows')
    return report(batch)

  return compile_at


@pytest.mark.parametrize('limit', [1, 3, 64, 100, 512, 700, 4096, 10**6])
@pytest.mark.parametrize('guess', [None, 1, 48, 600, 10**5])
def test_the_search_picks_the_largest_fitting_power_of_two(limit, guess):
  calls = []
  batch, outcomes = compile_tool.search_batch(
      fake_compile(limit, calls), start=64, cap=1024, guess=guess
  )
  powers = [2**k for k in range(11) if 2**k <= limit]
  assert batch == max(powers)
  assert len(calls) == len(set(calls)) == len(outcomes)  # nothing compiled twice
  assert all(b & (b - 1) == 0 and b <= 1024 for b in calls)  # powers of two under the cap
  assert isinstance(outcomes[batch], compile_tool.Report)
  if batch < 1024:  # the next doubling was tried and did not fit
    assert isinstance(outcomes[2 * batch], compile_tool.DoesNotFit)


def test_a_good_guess_costs_two_compiles_and_nothing_fitting_gives_none():
  calls = []
  assert (
      compile_tool.search_batch(fake_compile(300, calls), start=64, cap=1024, guess=300)[0] == 256
  )
  assert calls == [256, 512]
  calls = []
  assert compile_tool.search_batch(fake_compile(0, calls), start=8, cap=64)[0] is None
  assert calls == [8, 4, 2, 1]
  # Seeded outcomes are not compiled again; an odd start halves while it can.
  calls = []
  seeded = {6: report(6)}
  assert (
      compile_tool.search_batch(
          fake_compile(30, calls), start=6, cap=100, guess=6, outcomes=seeded
      )[0]
      == 24
  )
  assert calls == [12, 24, 48]
  assert compile_tool.batch_ladder(6, 100) == [3, 6, 12, 24, 48, 96]


def test_choose_batch_tries_remat_only_where_none_stops_fitting_under_the_goal():
  limits = {'none': 256, 'dots_saveable': 512, 'full': 2048}
  # MFU rises with the batch; recomputation costs dots_saveable 10%, full 25%.
  cost = {'none': 1.0, 'dots_saveable': 0.9, 'full': 0.75}
  calls = []

  def compile_fn(config, topology, *, name):
    batch, remat = config.per_device_batch_size, config.model.remat
    calls.append((remat, batch))
    if batch > limits[remat]:
      raise compile_tool.DoesNotFit(f'{name} needs more')
    return report(batch, remat, mfu=cost[remat] * batch / (batch + 256))

  config = config_lib.load(f'{ROOT}/configs/lm.py')
  best, trials = compile_tool.choose_batch(
      config, 'v5p:2x2x4', name='lm', goal=0.9, max_factor=64, compile_fn=compile_fn
  )
  # none: 64 (the config's), then the search; dots_saveable at 512 (0.9 x 0.667 = 0.6 > 0.5);
  # full at 512 (0.5, not above 0.5: stop).
  assert [(t.remat, t.batch) for t in trials] == calls
  assert calls[0] == ('none', 64) and ('none', 512) in calls and ('none', 256) in calls
  assert calls[-3:] == [('dots_saveable', 512), ('dots_saveable', 1024), ('full', 512)]
  assert (best.remat, best.per_device_batch_size) == ('dots_saveable', 512)
  assert best.mfu == pytest.approx(0.9 * 512 / 768)
  # Goal met with none: no remat compile.
  calls.clear()
  best, _ = compile_tool.choose_batch(
      config, 'v5p:2x2x4', name='lm', goal=0.4, max_factor=64, compile_fn=compile_fn
  )
  assert {remat for remat, _ in calls} == {'none'} and best.per_device_batch_size == 256


def test_the_bound_against_a_hand_computation():
  # v5p: 459 TFLOP/s over 2,765 GB/s = 166.0 FLOP/B.
  assert compile_tool.ridge_point(V5P) == pytest.approx(166.00, abs=0.01)
  compute = report(xla_flops=1e12, xla_bytes=5e9)  # 200 FLOP/B
  memory = report(xla_flops=1e12, xla_bytes=7e9)  # 142.9 FLOP/B
  assert compute.intensity == pytest.approx(200.0) and compute.bound == 'compute'
  assert memory.intensity == pytest.approx(142.857, abs=1e-3) and memory.bound == 'memory'
  assert compile_tool.roofline_bound(166.1e9, 1e9, V5P) == 'compute'
  assert compile_tool.roofline_bound(165.9e9, 1e9, V5P) == 'memory'
  # The roofline: 1 TFLOP at 459 TFLOP/s is 2.18 ms; 7 GB at 2,765 GB/s is 2.53 ms.
  assert memory.roofline_secs == pytest.approx(7e9 / 2765e9)
  # [8192, 512] x [512, 512] in bfloat16: 2 x 8192 x 512 x 512 FLOPs over
  # 2 x (8192 x 512 + 512 x 512 + 8192 x 512) bytes = 4,294,967,296 / 17,301,504.
  assert compile_tool.matmul_intensity_limit(8192, 512, 512) == pytest.approx(248.24, abs=0.01)
  assert compile_tool.matmul_intensity_limit(10**9, 512, 512) == pytest.approx(256, abs=0.01)


def test_what_would_lift_it_follows_the_numbers():
  model = dict(emb_dim=512, vocab=30_522, length=64, head_dim=64)
  small = report(64, mfu=0.2, xla_flops=1e12, xla_bytes=1e10)  # 100 FLOP/B
  big = report(1024, mfu=0.25, xla_flops=1e12, xla_bytes=9.5e9)  # 105 FLOP/B
  big.bytes_by_kind = {'matmul': 3.0, 'vocab': 5.0, 'elementwise': 1.5, 'collective': 0.5}
  trials = [compile_tool.Trial('none', 64, small), compile_tool.Trial('none', 1024, big)]
  note = compile_tool.lift_note(big, trials, 0.5, **model)
  # MFU <= analytic / FLOPs x intensity / ridge: 1 / 0.5 x 105.3 / 166 (analytic FLOPs are
  # 0.25 x 10 ms x 16 x 459 TFLOP/s = 18.4 TFLOP against 16 x 1 TFLOP: ratio 0.87).
  ratio = 16e12 / (0.25 * 0.01 * 16 * 459e12)
  assert note.startswith(
      f'memory-bound: 105 < 166 FLOP/B caps MFU at '
      f'{100 * (1e12 / 9.5e9) / (459e12 / 2765e9) / ratio:.0f}%'
  )
  assert 'moved it only 100 -> 105' in note and 'does not help' in note
  assert 'vocab ops move 50% of the bytes' in note and '30,522' in note
  assert 'elementwise ops move 15% of the bytes' in note and 'collective' not in note
  assert 'wider model' not in note  # D=512: 256 FLOP/B >= 1.5 x 166
  # 'xla' attention on 64-token rows: q.k of [64, 64] x [64, 64] is 2 x 64^3 FLOPs over
  # 2 x 3 x 64^2 bytes = 21 FLOP/B.
  assert "through 'xla' on rows of 64 tokens: a head's q.k product reaches 21 FLOP/B" in note
  assert 'wider model (D >= 512)' in compile_tool.lift_note(
      big, trials, 0.5, **{**model, 'emb_dim': 256, 'vocab': 256}
  )
  splash = dataclasses.replace(big, kernels=('splash_mha_fwd',))
  assert "'xla'" not in compile_tool.lift_note(splash, trials, 0.5, **model)
  grown = report(1024, mfu=0.25, xla_flops=1e12, xla_bytes=7e9)  # 143 FLOP/B
  note = compile_tool.lift_note(
      grown,
      [compile_tool.Trial('none', 64, small), compile_tool.Trial('none', 1024, grown)],
      0.5,
      **model,
  )
  assert 'grew 100 -> 143' in note and 'vocab' not in note  # no byte split known
  assert compile_tool.lift_note(report(mfu=0.6), [], 0.5, **model) == 'goal met'
  # Compute-bound, XLA's estimate 2x its roofline (1 TFLOP: 2.18 ms; estimate 4.36 ms).
  slow = report(mfu=0.3, xla_flops=1e12, xla_bytes=1e9, xla_seconds=2 * 1e12 / 459e12)
  note = compile_tool.lift_note(slow, [], 0.5, **model)
  assert note.startswith('compute-bound (1000 >= 166') and "2.00x the step's roofline" in note


def test_chip_hours_and_the_paper_rows():
  # 300,000 steps of 250 ms on 16 chips: 300,000 x 0.25 x 16 / 3600 = 333.3 chip-hours.
  assert compile_tool.chip_hours(300_000, 0.25, 16) == pytest.approx(333.333, abs=1e-3)
  runs = [
      compile_tool.PaperRun('a', 'configs/mlm.py:bert_large', 'v5p:2x2x4', 900_000, 'S'),
      compile_tool.PaperRun('b', 'configs/mlm.py:bert_large', 'v5p:2x2x4', 100_000, 'S'),
      compile_tool.PaperRun('c', 'configs/mlm.py:bert_large', 'v5p:2x2x4', 10, 'T'),
  ]
  outcomes = {
      runs[0]: report(16, xla_seconds=0.1),
      runs[1]: report(16, xla_seconds=0.4),
      runs[2]: compile_tool.DoesNotFit('c needs 99.00 GiB per chip'),
  }
  # 900,000 x 0.1 x 16 / 3600 = 400; 100,000 x 0.4 x 16 / 3600 = 177.8: 577.8 chip-hours,
  # 36.1 hours on 16 chips. T does not fit: no total.
  assert compile_tool.schedule_totals(runs, outcomes) == [
      '- S: 578 chip-hours (36.1 hours on 16 chips)'
  ]
  outcomes[runs[1]] = report(16, xla_seconds=4.0)  # 1,777.8 more: 2,177.8 / 16 / 24 days
  assert compile_tool.schedule_totals(runs, outcomes) == [
      '- S: 2,178 chip-hours (5.7 days on 16 chips)'
  ]
  row = compile_tool.paper_row(runs[0], outcomes[runs[0]]).split(' | ')
  assert row[3] == '256 x 128' and row[-1] == '400 |' and row[-2] == '900,000'
  assert '| no | 99.00 GiB needed |' in compile_tool.paper_row(runs[2], outcomes[runs[2]])


HLO = """\
  %param_0.1 = bf16[32,128,512]{2,1,0} parameter(0)
  %param_1.1 = bf16[512,512]{1,0} parameter(1)
  %convolution.7 = bf16[32,128,512]{2,1,0} convolution(%param_0.1, %param_1.1), window={size=1}
  %fusion.3 = f32[32,4,128,128]{3,2,1,0} fusion(%a), kind=kLoop
  %dot.2 = f32[32,4,128,32]{3,2,1,0} dot(%fusion.3, %param_0.1), lhs_contracting_dims={3}
  %splash_mha_fwd_segmented_residuals.2 = (f32[32,128,128]{2,1,0}, bf16[32,4,128,32]) \
custom-call(%c, %q), custom_call_target="tpu_custom_call", operand_layout_constraints={}
  %splash_mha_dq_segmented_no_residuals.1 = (f32[32,128,32]{2,1,0}) custom-call(%c), \
custom_call_target="tpu_custom_call"
  %custom-call.4 = f32[8]{0} custom-call(%c), custom_call_target="AllocateBuffer"
"""


def test_the_compiled_programs_kernels_and_matmul_dtypes():
  assert compile_tool.mosaic_kernels(HLO) == (
      'splash_mha_dq_segmented_no_residuals',
      'splash_mha_fwd_segmented_residuals',
  )
  assert compile_tool.matmul_operand_dtypes(HLO) == {'bf16 x bf16': 1, 'f32 x bf16': 1}
  r = dataclasses.replace(report(), kernels=compile_tool.mosaic_kernels(HLO))
  assert r.attention == 'splash' and report().attention == 'xla'


def test_paper_scale_variants_are_valid_and_sized_as_the_papers():
  big = config_lib.load(f'{ROOT}/configs/nmt.py:transformer_big')
  config_lib.validate(big)
  model = config_lib.model_config(big, vocab_size=big.data.vocab_size)
  assert (
      model.num_encoder_layers,
      model.num_decoder_layers,
      model.emb_dim,
      model.mlp_dim,
      model.encoder_attention.num_heads,
  ) == (6, 6, 1024, 4096, 16)
  assert model.dropout_rate == 0.3 and big.data.vocab_size == 32_000 and big.data.packing
  spec = compile_tool.batch_spec(big, num_devices=16)  # v5p-32: ~25k tokens per side
  assert spec['inputs'].shape == spec['targets'].shape == (96, 256)
  assert big.num_train_steps == 300_000

  bert = config_lib.load(f'{ROOT}/configs/mlm.py:bert_large')
  config_lib.validate(bert)
  model = config_lib.model_config(bert, vocab_size=30_522)
  assert (
      model.num_encoder_layers,
      model.emb_dim,
      model.mlp_dim,
      model.encoder_attention.num_heads,
      model.norm,
  ) == (24, 1024, 4096, 16, 'post')
  assert compile_tool.batch_spec(bert, num_devices=16)['inputs'].shape == (256, 512)
  assert bert.num_train_steps == 1_000_000
  # The paper rows price these variants (BERT's two phases and the 1M steps at L=512).
  priced = {run.config for run in compile_tool.PAPER_RUNS}
  assert priced == {'configs/nmt.py:transformer_big', 'configs/mlm.py:bert_large'}
  assert (
      sum(
          run.steps
          for run in compile_tool.PAPER_RUNS
          if run.schedule.startswith("BERT-large, BERT's")
      )
      == 1_000_000
  )


def test_splash_flops_are_the_attention_products_of_the_layers_auto_gives_splash():
  """XLA's cost analysis leaves Mosaic kernels out; the table adds their FLOPs back: q.k and
  w.v of each splash layer, 3x forward, by hand for configs/lm.py (6 causal layers, 8 heads
  of 64, rows of 256 tokens: 'auto' picks splash on TPU) and none for configs/nmt.py (64)."""
  lm = config_lib.load(f'{ROOT}/configs/lm.py')
  lm.model.attention.platform = 'tpu'
  model = config_lib.model_config(lm, vocab_size=256)
  rows = 16 * 64
  by_hand = 6 * 3 * 2 * rows * 256 * 256 * (8 * 64 + 8 * 64)
  assert compile_tool.splash_flops(model, tasks.get('lm'), rows, 256) == by_hand
  # Attention dropout keeps 'auto' off splash (the kernel has none): nothing to add.
  lm.model.attention.dropout_rate = 0.1
  model = config_lib.model_config(lm, vocab_size=256)
  assert compile_tool.splash_flops(model, tasks.get('lm'), rows, 256) == 0
  nmt = config_lib.load(f'{ROOT}/configs/nmt.py')
  nmt.model.attention.platform = 'tpu'
  model = config_lib.model_config(nmt, vocab_size=8000)
  assert compile_tool.splash_flops(model, tasks.get('nmt'), rows, 64) == 0
  # Added to XLA's count and, at peak, to its step time.
  r = dataclasses.replace(report(xla_seconds=0.01), kernel_flops=4.59e12)
  assert r.step_secs == pytest.approx(0.02) and r.flops == pytest.approx(1e12 + 4.59e12)


PROGRAM = """\
%fused_computation.1 (param_0: bf16[64,512], param_1: bf16[512,512]) -> bf16[64,512] {
  %param_0 = bf16[64,512]{1,0} parameter(0)
  %param_1 = bf16[512,512]{1,0} parameter(1)
  ROOT %convolution.1 = bf16[64,512]{1,0} convolution(%param_0, %param_1), dim_labels=bf_io->bf
}

%fused_computation.2 (param_0.2: bf16[64,512]) -> f32[64,512] {
  %param_0.2 = bf16[64,512]{1,0} parameter(0)
  ROOT %convert.1 = f32[64,512]{1,0} convert(%param_0.2)
}

ENTRY %main.9 (param.1: bf16[64,512], param.2: bf16[512,512], param.3: bf16[512,1000]) -> f32[] {
  %param.1 = bf16[64,512]{1,0} parameter(0)
  %param.2 = bf16[512,512]{1,0} parameter(1)
  %param.3 = bf16[512,1000]{1,0} parameter(2)
  %fusion.1 = bf16[64,512]{1,0} fusion(%param.1, %param.2), kind=kOutput, calls=%fused_computation.1
  %fusion.2 = f32[64,512]{1,0} fusion(%fusion.1), kind=kLoop, calls=%fused_computation.2
  %splash_mha_fwd.1 = (bf16[64,512]{1,0}) custom-call(%fusion.1), \
custom_call_target="tpu_custom_call", backend_config={"kernel": "splash",
"xprof_metadata": "a string broken over lines"}, metadata={op_name="splash"}
  %convolution.2 = f32[64,1000]{1,0} convolution(%fusion.1, %param.3), dim_labels=bf_io->bf
  %bitcast.1 = f32[32768]{0} bitcast(%fusion.2)
  %all-reduce.1 = f32[32768]{0} all-reduce(%bitcast.1), replica_groups={}, to_apply=%add
  ROOT %reduce.1 = f32[] reduce(%convolution.2, %c), dimensions={0,1}, to_apply=%add
}
"""


def test_hbm_bytes_by_kind_by_hand():
  kinds = compile_tool.hbm_bytes_by_kind(PROGRAM, vocab_size=1000)
  assert kinds == {
      # fusion.1 reads x [64,512] and W [512,512] bf16, writes [64,512] bf16.
      'matmul': 2 * (64 * 512 + 512 * 512 + 64 * 512),
      # convolution.2 reads x and the [512,1000] output layer, writes f32 [64,1000] logits;
      # reduce.1 reads the logits and writes a scalar.
      'vocab': 2 * 64 * 512 + 2 * 512 * 1000 + 4 * 64 * 1000 + 4 * 64 * 1000 + 4,
      # The Mosaic call (its backend_config spans two lines) reads and writes [64,512] bf16;
      # the instructions after it are still counted.
      'attention kernel': 2 * 2 * 64 * 512,
      'collective': 2 * 4 * 32768,  # reads and writes the bitcast's f32[32768]
      'elementwise': 2 * 64 * 512 + 4 * 64 * 512,  # fusion.2: bf16 in, f32 out
  }


def test_the_goal_is_v5p_32s_and_other_slices_only_say_their_bound():
  model = dict(emb_dim=512, vocab=256, length=256, head_dim=64)
  fast = report(mfu=0.6, xla_flops=1e12, xla_bytes=1e10)  # memory-bound, over the goal
  on_v5p = compile_tool.main_row('lm', 'v5p:2x2x4', fast, [], 0.5, **model).split(' | ')
  assert on_v5p[9] == '60% (50%)' and on_v5p[14] == 'goal met'
  on_v5e = compile_tool.main_row('lm', 'v5e:4x4', fast, [], 0.5, **model).split(' | ')
  assert on_v5e[9] == '60%' and on_v5e[14].startswith('memory-bound: 100 < 166 FLOP/B')
