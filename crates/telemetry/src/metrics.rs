//! Prometheus exposition: a registry and the HTTP endpoint that serves it.
