"""Who owns each slot, and when to restore, save and erase: the decisions between the adapters and the
store (docs/ARCHITECTURE.md, "The coordinator")."""
