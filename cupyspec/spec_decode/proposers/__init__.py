"""Draft proposers behind one interface (`base.Proposer`): ngram, suffix, and chains of two."""
