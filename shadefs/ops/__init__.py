"""Operations: warm-up, the live view, Prometheus metrics and systemd notification."""
