"""The transformers rollout engine: :class:`~.engine.HFEngine` (runs anywhere), its prefill
(:mod:`.prefill`) and decode (:mod:`.decode`, :mod:`.decode_runner`, :mod:`.kv_cache`,
:mod:`.sampling`), continuous batching (:mod:`.scheduler`), the plain transformers loop for
models our decode does not cover (:mod:`.legacy`) and the in-place weight loader
(:mod:`.weights`). The engine imports transformers (seconds)."""
