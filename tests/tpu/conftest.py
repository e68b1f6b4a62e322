"""tests/tpu: the scripts of tpu/ are not a package and import each other by name (compile.py
imports chips), so their folder goes on sys.path and the tests import them the same way."""

import pathlib
import sys

TPU_DIR = pathlib.Path(__file__).resolve().parents[2] / 'tpu'
if str(TPU_DIR) not in sys.path:
  sys.path.insert(0, str(TPU_DIR))
