"""Reports of a grid's results: line plots with a band over seeds, Markdown tables, README
sections written between markers."""

from collections.abc import Iterable, Mapping, Sequence
import os
import pathlib
from typing import Any

from experiments.runner import files
from experiments.runner.results import aggregate


def plot_lines(
    rows: Iterable[Mapping[str, Any]],
    *,
    x: str,
    y: str,
    out: str | os.PathLike,
    group: str | Sequence[str] | None = None,
    spread: str | None = 'minmax',
    title: str | None = None,
    xlabel: str | None = None,
    ylabel: str | None = None,
    logx: bool = False,
    logy: bool = False,
) -> dict[str, dict[str, list]]:
  """`y` against `x`, one line per value of `group`, written to `out` (a PNG or PDF).

  Rows that share the group and x (e.g. seeds) become one point: their mean, with a band
  over their min..max (`spread='minmax'`) or mean ± sample std (`'std'`), or no band (None).
  Returns the plotted series, {label: {'x', 'mean', 'lo', 'hi', 'n'}}.
  """
  if spread not in ('minmax', 'std', None):
    raise ValueError(f"spread must be 'minmax', 'std' or None, got {spread!r}")
  by = [group] if isinstance(group, str) else list(group or ())
  rows = [row for row in rows if row.get(x) is not None and row.get(y) is not None]
  series: dict[str, dict[str, list]] = {}
  for label_row in aggregate(rows, by, ()):
    label = ', '.join(f'{key}={label_row[key]}' for key in by) or y
    members = [row for row in rows if all(row.get(k) == label_row[k] for k in by)]
    points = sorted(aggregate(members, [x], [y]), key=lambda p: p[x])
    lo = [p[f'{y}_min'] if spread == 'minmax' else p[y] - p[f'{y}_std'] for p in points]
    hi = [p[f'{y}_max'] if spread == 'minmax' else p[y] + p[f'{y}_std'] for p in points]
    series[label] = {
        'x': [p[x] for p in points],
        'mean': [p[y] for p in points],
        'lo': lo,
        'hi': hi,
        'n': [p['n'] for p in points],
    }

  # The object API with the Agg canvas: no pyplot state, no display needed.
  from matplotlib.backends.backend_agg import FigureCanvasAgg
  from matplotlib.figure import Figure
  from matplotlib.patches import Patch

  fig = Figure(figsize=(6.4, 4.2), layout='constrained')
  FigureCanvasAgg(fig)
  ax = fig.add_subplot()
  handles, has_band = [], False
  band_label = {'minmax': 'min–max over seeds', 'std': '± std over seeds'}.get(spread)
  for label, s in series.items():
    (line,) = ax.plot(
        s['x'], s['mean'], marker='o' if len(s['x']) < 30 else None, markersize=4, label=label
    )
    handles.append(line)
    if spread and max(s['n']) > 1:
      ax.fill_between(s['x'], s['lo'], s['hi'], color=line.get_color(), alpha=0.2, lw=0)
      has_band = True
  if has_band:  # one grey legend entry for all bands, last
    handles.append(Patch(color='grey', alpha=0.3, label=band_label))
  ax.set_xlabel(xlabel or x)
  ax.set_ylabel(ylabel or y)
  if logx:
    ax.set_xscale('log')
    xs = sorted({v for s in series.values() for v in s['x']})
    if len(xs) <= 12:  # label the grid's own values (16, 32, ...), not powers of ten
      ax.set_xticks(xs, [format(v, 'g') for v in xs])
      ax.minorticks_off()
  if logy:
    ax.set_yscale('log')
  if title:
    ax.set_title(title)
  ax.grid(alpha=0.3)
  if len(handles) > 1:
    ax.legend(handles=handles, fontsize='small')
  pathlib.Path(out).parent.mkdir(parents=True, exist_ok=True)
  fig.savefig(out, dpi=120)
  return series


def markdown_table(
    rows: Iterable[Mapping[str, Any]], columns: Sequence[Any], *, floatfmt: str = '.4g'
) -> str:
  """A Markdown table: one line per row.

  A column is a key (also its header), `(header, key)` or `(header, fn)` with `fn(row)` giving
  the cell. Floats are written with `floatfmt`, None as an empty cell.
  """
  specs = [(c, c) if isinstance(c, str) else tuple(c) for c in columns]

  def cell(row, getter):
    value = getter(row) if callable(getter) else row.get(getter)
    if value is None:
      return ''
    if isinstance(value, float):
      value = format(value, floatfmt)
    return str(value).replace('|', '\\|').replace('\n', ' ')

  lines = [
      '| ' + ' | '.join(header for header, _ in specs) + ' |',
      '|' + '|'.join('---' for _ in specs) + '|',
  ]
  lines += ['| ' + ' | '.join(cell(row, getter) for _, getter in specs) + ' |' for row in rows]
  return '\n'.join(lines) + '\n'


def write_section(path: str | os.PathLike, name: str, text: str) -> None:
  """Replaces what lies between `<!-- name -->` and `<!-- /name -->` in a README."""
  path = pathlib.Path(path)
  begin, end = f'<!-- {name} -->', f'<!-- /{name} -->'
  content = path.read_text()
  if (
      content.count(begin) != 1
      or content.count(end) != 1
      or content.index(begin) > content.index(end)
  ):
    raise ValueError(f'{path} must hold the markers {begin} and {end} once each, in that order')
  head, rest = content.split(begin)
  _, tail = rest.split(end)
  files.write_text(path, f'{head}{begin}\n{text.strip()}\n{end}{tail}')
