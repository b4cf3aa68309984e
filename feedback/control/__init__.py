"""The Redis control plane: which drafter each tenant runs, swap/rollback/drift news, load heartbeats, live acceptance."""
