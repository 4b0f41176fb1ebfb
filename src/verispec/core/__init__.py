"""The core loop: the engine (draft, verify, accept, emit), acceptance rules, draft trees, the
logits pipeline, sampling parameters and outputs, and the prefix cache."""
