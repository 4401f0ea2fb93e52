"""The SGLang client: one engine class per module, :class:`~.engine.SGLangEngine` (in-process)
and :class:`~.client.SGLangClient` (a server over HTTP, launched by :class:`~.server.SGLangServer`
or already running), over what they share (:mod:`.common`) and the HTTP payloads
(:mod:`.protocol`). Nothing here imports sglang until an engine is built."""
