"""The trace bus: the TraceRecord schema, its wire codec, and the sinks and source that carry it (in process, Kafka)."""
