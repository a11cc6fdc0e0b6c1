"""Speculative decoding: drafts proposed per request, verified by one target forward (TARGET_VERIFY).

ngram_trie (the n-gram index of a request's tokens), ngram_drafter (who drafts, how much, back-off),
verify (accepting drafts from the target's logits), verify_batch (KV for a verify step and giving
back the rejected part), worker (SpeculativeWorker: the target worker wrapped with the draft).
"""
