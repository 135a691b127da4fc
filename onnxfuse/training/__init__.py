"""A training run (the layer above the runtimes and the measurements): the loop (``run.py``: ``train_array``,
``verify_array``), its state, checkpoints and best states, run-time verification, successive halving, the GAN loop
and the report of a run. Import from the module that defines a name; this package re-exports nothing, so importing
it imports no runtime."""
