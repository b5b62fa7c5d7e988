"""The training loop and what it saves. `train(cfg)` is the entry point."""
