"""Test and benchmark harnesses: role processes with READY handshakes, network namespaces, and
chunk transports that misbehave on purpose. Importable by tests and bench/, never by roles."""
