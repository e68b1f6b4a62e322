"""Our TFDS builders. Importing this package registers them with TFDS by name
(`multi30k`, `multi30k_captions`, `ud_english_ewt`, `shakespeare/{full_works,tiny}`), so
`tfds.data_source(name, data_dir=..., builder_kwargs={'raw_data_dir': ...})` works too."""

from lowrank_attn.data.builders.multi30k import Multi30k, Multi30kCaptions
from lowrank_attn.data.builders.shakespeare import Shakespeare
from lowrank_attn.data.builders.ud_english_ewt import UdEnglishEwt, parse_conllu

__all__ = ['Multi30k', 'Multi30kCaptions', 'Shakespeare', 'UdEnglishEwt', 'parse_conllu']
