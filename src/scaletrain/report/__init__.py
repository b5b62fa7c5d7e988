"""Plots and reports for people; the library computes, this draws."""
