//! Logs and traces: the subscriber, the OTLP exporter and W3C trace context propagation.
