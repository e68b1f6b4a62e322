"""A lower floor never imports a higher one: kernels < layers < models < research and training.

Each package is imported in a fresh interpreter (this one has loaded everything), and the
modules it loaded are read from `sys.modules`. The kernels also never import a higher floor
inside a function (the layers may: `MultiHeadAttention.from_flax` calls into reparam).
"""

import ast
import json
import os
import pathlib
import subprocess
import sys

import pytest

PACKAGE = pathlib.Path(__file__).resolve().parents[1] / 'lowrank_attn'

ABOVE_THE_LAYERS = (
    'lowrank_attn.reparam',
    'lowrank_attn.train',
    'lowrank_attn.data',
    'lowrank_attn.pruning',
    'lowrank_attn.analysis',
    'lowrank_attn.tasks',
)
# package -> the packages (and third-party modules) importing it must not load.
FLOORS = {
    'lowrank_attn.attention': ('lowrank_attn.nn', 'lowrank_attn.models', *ABOVE_THE_LAYERS, 'flax'),
    'lowrank_attn.nn': ('lowrank_attn.models', *ABOVE_THE_LAYERS),
    'lowrank_attn.models': ABOVE_THE_LAYERS,
}


def loaded_modules(package: str) -> list[str]:
  code = f'import sys, json; import {package}; print(json.dumps(sorted(sys.modules)))'
  env = dict(os.environ, JAX_PLATFORMS='cpu')
  result = subprocess.run(
      [sys.executable, '-c', code], capture_output=True, text=True, env=env, check=True, timeout=120
  )
  return json.loads(result.stdout.splitlines()[-1])


@pytest.mark.integration  # a fresh Python per floor: sys.modules of this one is shared
@pytest.mark.parametrize('package', list(FLOORS))
def test_a_floor_does_not_load_the_floors_above_it(package):
  modules = loaded_modules(package)
  assert package in modules
  above = [
      m for m in modules if any(m == name or m.startswith(name + '.') for name in FLOORS[package])
  ]
  assert not above, f'importing {package} loads {above}'


def imported_names(path: pathlib.Path) -> set[str]:
  """Every module an `import` or `from ... import` in the file names, at any depth."""
  names = set()
  for node in ast.walk(ast.parse(path.read_text())):
    if isinstance(node, ast.Import):
      names.update(alias.name for alias in node.names)
    elif isinstance(node, ast.ImportFrom) and node.module:
      names.add(node.module)
      names.update(f'{node.module}.{alias.name}' for alias in node.names)
  return names


@pytest.mark.parametrize('path', sorted((PACKAGE / 'attention').glob('*.py')), ids=lambda p: p.name)
def test_kernels_never_import_a_higher_floor(path):
  banned = FLOORS['lowrank_attn.attention']
  found = sorted(
      n
      for n in imported_names(path)
      if any(n == name or n.startswith(name + '.') for name in banned)
  )
  assert not found, f'{path.name} imports {found}'
