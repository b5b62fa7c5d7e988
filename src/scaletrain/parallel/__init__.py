"""How one model becomes many processes. `parallelize` in apply.py is the entry point train/ calls."""
