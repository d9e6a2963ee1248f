"""The text-lm model family's own parts: corpus, text contract, tokenizer, model, evaluators.

Framework-free like the rest of ``pipeline/``. Nothing is imported here: each module imports
what it needs (torch, pandas, great-expectations) itself, so importing one part stays quick.
See docs/text-lm.md for what each module holds and what remains to wire.
"""
