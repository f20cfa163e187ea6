"""The hook API: its routes (hooks, sessions, admin), their bodies and the models of its answers."""
