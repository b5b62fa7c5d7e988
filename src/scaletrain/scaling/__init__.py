"""Scaling laws as arithmetic: law forms and published laws, fitting, and the optima they imply.
Imports no torch (NumPy and SciPy only), so planning starts instantly."""
