"""The process transport: the engine-core process, its asyncio client, and the typed messages
between them (msgpack over ZMQ)."""
