"""Multi30k en->de: the translation baseline (issue 11): learning curve of a run."""
