"""Data curation (Sec. 3, App. D): path sampling, fuzzy rewriting, anchor grounding, staged
filtering, degradation and trajectory synthesis, each a resumable stage over JSONL records."""
